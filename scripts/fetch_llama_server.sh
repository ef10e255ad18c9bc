#!/usr/bin/env bash
# fetch_llama_server.sh: download an official llama.cpp release build of llama-server.
#
#   scripts/fetch_llama_server.sh BACKEND [BUILD] [options]
#   meshnet-gguf serve --llama-server "$(scripts/fetch_llama_server.sh vulkan)" ...
#
# BACKEND  cpu | vulkan | rocm   (Linux; arch from `uname -m`: x64, arm64; s390x for cpu)
#          macos                 (arm64 by default; --arch x64 for Intel Macs)
# BUILD    a release tag such as b6500; default "latest" (GitHub API releases/latest).
#
# The archive is extracted keeping its symlinks (libggml.so -> libggml.so.0 ...) into
#   ${MESHNET_LLAMA_DIR:-$HOME/.local/share/meshnet/llama.cpp}/<build>-<backend>
# and the absolute path of llama-server is printed as the LAST line of stdout; every
# other message goes to stderr. A build already installed there is reused (--force
# replaces it). Exit status: 0 ok, 1 failure (network, checksum, bad archive), 2 usage.
#
# Asset names. Checked against ggml-org/llama.cpp .github/workflows/release.yml (the
# "Pack artifacts" steps and the release notes' download links) and release listings
# quoted in upstream issues (#23115 for b9165, b10356's listing in meta-oss-cookbook#27):
#   cpu     llama-<tag>-bin-ubuntu-<x64|arm64|s390x>.tar.gz
#   vulkan  llama-<tag>-bin-ubuntu-vulkan-<x64|arm64>.tar.gz
#   rocm    llama-<tag>-bin-ubuntu-rocm-<rocm major.minor>-x64.tar.gz   (7.2, later 7.14)
#   macos   llama-<tag>-bin-macos-<arm64|x64>.tar.gz
# .tar.gz (top folder llama-<tag>/, symlinks stored) arrived with ggml-org/llama.cpp#17299
# (Nov 2025, around b7100) and replaced .zip for Linux/macOS after the deprecation notice of
# b7312 (Dec 2025). Older builds (e.g. b4282, b5921) ship the same stem as .zip with a
# build/bin/ folder; when the asset list cannot be read the script tries .tar.gz, then .zip.
# The ROCm asset name carries the ROCm version, so for rocm the script reads the release's
# asset list from the GitHub API and takes the newest ROCm build for the arch (pin one with
# --rocm-version). Windows assets (.zip, e.g. bin-win-hip-radeon-x64) are not handled.
# If upstream renames again: --asset NAME downloads exactly NAME from the release
# ("{tag}" in NAME is replaced by the resolved tag).
#
# Environment: MESHNET_LLAMA_DIR (install root), MESHNET_LLAMA_ARCH (= --arch),
# MESHNET_LLAMA_ROCM_VERSION (= --rocm-version), MESHNET_FETCH_TIMEOUT (= --timeout),
# MESHNET_LLAMA_REPO (default ggml-org/llama.cpp), MESHNET_LLAMA_GITHUB and
# MESHNET_LLAMA_GITHUB_API (mirrors; file:// works, which is how the tests run offline),
# MESHNET_FETCH_UNZIP (python3|bsdtar|unzip: force the zip extractor), GITHUB_TOKEN (sent
# to the API only, to lift its rate limit).
set -euo pipefail

PROG=${0##*/}
REPO=${MESHNET_LLAMA_REPO:-ggml-org/llama.cpp}
GITHUB=${MESHNET_LLAMA_GITHUB:-https://github.com}
GITHUB_API=${MESHNET_LLAMA_GITHUB_API:-https://api.github.com}
INSTALL_ROOT=${MESHNET_LLAMA_DIR:-${HOME:-/nonexistent}/.local/share/meshnet/llama.cpp}
# ROCm versions tried, in order, only when the release's asset list cannot be read.
ROCM_VERSIONS_GUESS=(7.14 7.2)
MARKER=.meshnet-fetch
# Seconds one asset download may take in all (large ROCm builds on slow links).
DOWNLOAD_TIMEOUT_S=${MESHNET_FETCH_TIMEOUT:-1800}
API_TIMEOUT_S=60
CONNECT_TIMEOUT_S=20
RETRIES=3

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}
usage_error() {
    log "error: $*"
    printf "Run '%s --help' for usage.\n" "$PROG" >&2
    exit 2
}

usage() {
    cat <<EOF
Usage: $PROG BACKEND [BUILD] [options]

Download the official llama.cpp release asset for BACKEND, extract it (symlinks kept)
and print the absolute path of its llama-server as the last line of stdout.

  BACKEND           cpu | vulkan | rocm (Linux)   macos (arm64 default, --arch x64)
  BUILD             release tag, e.g. b6500 (default: latest, via the GitHub API)

Options:
  --dest DIR        install here (default: \$MESHNET_LLAMA_DIR/<build>-<backend>,
                    \$MESHNET_LLAMA_DIR defaulting to ~/.local/share/meshnet/llama.cpp)
  --arch ARCH       x64 | arm64 | s390x (default: this machine for Linux, arm64 for macos)
  --asset NAME      download this release asset instead of the computed name
                    ({tag} is replaced by the build)
  --rocm-version V  ROCm major.minor in the rocm asset name (default: newest published)
  --sha256 HEX      verify the archive against this SHA-256
  --archive FILE    install a local .tar.gz/.zip instead of downloading
  --timeout SEC     limit for the whole download (default: $DOWNLOAD_TIMEOUT_S)
  --force           replace an existing install of the same build
  --dry-run         print the URL(s) that would be fetched, touch nothing, exit 0
  -h, --help        this help

Example:
  meshnet-gguf serve --gguf model.gguf --llama-server "\$($PROG vulkan b6500)"
EOF
}

# ---------------------------------------------------------------- arguments
# Written for bash 3.2 too (macOS /bin/bash): no mapfile, no ${x,,}, no empty "${a[@]}".
dest="" arch=${MESHNET_LLAMA_ARCH:-} asset_override="" archive="" sha256=""
rocm_version=${MESHNET_LLAMA_ROCM_VERSION:-} dry_run=0 force=0
positional=()

need_value() {
    if [[ $# -lt 2 || -z $2 ]]; then usage_error "$1 needs a value"; fi
}

while [[ $# -gt 0 ]]; do
    case $1 in
    --dest=* | --arch=* | --asset=* | --sha256=* | --archive=* | --rocm-version=* | --timeout=*)
        set -- "${1%%=*}" "${1#*=}" "${@:2}"
        ;;
    esac
    case $1 in
    -h | --help)
        usage
        exit 0
        ;;
    --dry-run) dry_run=1 ;;
    --force) force=1 ;;
    --dest | --arch | --asset | --sha256 | --archive | --rocm-version | --timeout)
        need_value "$@"
        case $1 in
        --dest) dest=$2 ;;
        --arch) arch=$2 ;;
        --asset) asset_override=$2 ;;
        --sha256) sha256=$(printf '%s' "$2" | tr 'A-F' 'a-f') ;;
        --archive) archive=$2 ;;
        --rocm-version) rocm_version=$2 ;;
        --timeout) DOWNLOAD_TIMEOUT_S=$2 ;;
        esac
        shift
        ;;
    --)
        shift
        while [[ $# -gt 0 ]]; do
            positional+=("$1")
            shift
        done
        break
        ;;
    -*) usage_error "unknown option: $1" ;;
    *) positional+=("$1") ;;
    esac
    shift
done

if [[ ${#positional[@]} -lt 1 ]]; then usage_error "missing BACKEND (one of: cpu, vulkan, rocm, macos)"; fi
if [[ ${#positional[@]} -gt 2 ]]; then usage_error "too many arguments: ${positional[*]:2}"; fi
backend=${positional[0]}
build=latest
if [[ ${#positional[@]} -eq 2 ]]; then build=${positional[1]}; fi

case $backend in
cpu | vulkan | rocm | macos) ;;
*) usage_error "unknown backend '$backend' (expected one of: cpu, vulkan, rocm, macos)" ;;
esac
if ! [[ $build =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
    usage_error "bad BUILD '$build' (a release tag such as b6500, or latest)"
fi
if [[ -n $sha256 ]] && ! [[ $sha256 =~ ^[0-9a-f]{64}$ ]]; then usage_error "--sha256 wants 64 hex digits"; fi
if ! [[ $DOWNLOAD_TIMEOUT_S =~ ^[1-9][0-9]*$ ]]; then usage_error "timeout must be a positive number of seconds"; fi
if [[ -n $rocm_version ]] && ! [[ $rocm_version =~ ^[0-9]+(\.[0-9]+)*$ ]]; then
    usage_error "bad --rocm-version '$rocm_version' (e.g. 7.2)"
fi
if [[ -n $asset_override ]] && [[ $asset_override == */* || $asset_override == .* ]]; then
    usage_error "--asset wants a bare file name such as llama-{tag}-bin-ubuntu-x64.tar.gz"
fi

if [[ -z $arch ]]; then
    if [[ $backend == macos ]]; then
        arch=arm64
    else
        machine=$(uname -m)
        case $machine in
        x86_64 | amd64) arch=x64 ;;
        aarch64 | arm64) arch=arm64 ;;
        s390x) arch=s390x ;;
        *) usage_error "no llama.cpp $backend build for this machine ($machine); pass --arch or --asset" ;;
        esac
    fi
fi
case $backend/$arch in
cpu/x64 | cpu/arm64 | cpu/s390x | vulkan/x64 | vulkan/arm64 | rocm/x64 | macos/arm64 | macos/x64) ;;
*)
    if [[ -z $asset_override && -z $archive ]]; then
        usage_error "upstream publishes no $backend build for arch '$arch'" \
            "(cpu: x64 arm64 s390x; vulkan: x64 arm64; rocm: x64; macos: arm64 x64); --asset NAME forces one"
    fi
    ;;
esac
# rocm without a pinned version: the version comes from the release's asset list.
rocm_lookup=0
if [[ $backend == rocm && -z $rocm_version && -z $asset_override ]]; then rocm_lookup=1; fi

# ---------------------------------------------------------------- helpers
asset_stem() { # tag [rocm-version]
    case $backend in
    cpu) printf 'llama-%s-bin-ubuntu-%s' "$1" "$arch" ;;
    vulkan) printf 'llama-%s-bin-ubuntu-vulkan-%s' "$1" "$arch" ;;
    rocm) printf 'llama-%s-bin-ubuntu-rocm-%s-%s' "$1" "${2:-$rocm_version}" "$arch" ;;
    macos) printf 'llama-%s-bin-macos-%s' "$1" "$arch" ;;
    esac
}

candidate_assets() { # tag -> asset names to try, most likely first, one per line
    local v stem
    if [[ -n $asset_override ]]; then
        printf '%s\n' "${asset_override//\{tag\}/$1}"
    elif ((rocm_lookup)); then
        for v in "${ROCM_VERSIONS_GUESS[@]}"; do
            stem=$(asset_stem "$1" "$v")
            printf '%s\n' "$stem.tar.gz" "$stem.zip"
        done
    else
        stem=$(asset_stem "$1")
        printf '%s\n' "$stem.tar.gz" "$stem.zip"
    fi
}

# Published rocm assets for tag and arch: newest ROCm first, .tar.gz before .zip.
pick_rocm_assets() { # tag, then published names on stdin
    local prefix="llama-$1-bin-ubuntu-rocm-"
    sed -n -E "s/^(${prefix//./\\.}([0-9.]+)-$arch\.(tar\.gz|zip))$/\2 \3 \1/p" |
        sed -e 's/ tar\.gz / 0 /' -e 's/ zip / 1 /' | sort -k1,1Vr -k2,2n | cut -d' ' -f3
}

download_url() { printf '%s/%s/releases/download/%s/%s' "$GITHUB" "$REPO" "$1" "$2"; }

api_url() {
    if [[ $1 == latest ]]; then
        printf '%s/repos/%s/releases/latest' "$GITHUB_API" "$REPO"
    else
        printf '%s/repos/%s/releases/tags/%s' "$GITHUB_API" "$REPO" "$1"
    fi
}

sha256_of() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    elif command -v shasum >/dev/null 2>&1; then
        shasum -a 256 "$1" | cut -d' ' -f1
    else
        die "neither sha256sum nor shasum is installed"
    fi
}

fetch_api() { # url -> JSON on stdout
    local auth=()
    if [[ -n ${GITHUB_TOKEN:-} && $1 == https://api.github.com/* ]]; then
        auth=(-H "Authorization: Bearer $GITHUB_TOKEN")
    fi
    curl --fail --silent --show-error --location --retry "$RETRIES" --retry-delay 2 \
        --connect-timeout "$CONNECT_TIMEOUT_S" --max-time "$API_TIMEOUT_S" \
        -H 'Accept: application/vnd.github+json' ${auth[@]+"${auth[@]}"} "$1"
}

json_tag() { grep -o '"tag_name"[[:space:]]*:[[:space:]]*"[^"]*"' | head -n 1 | sed 's/.*"\([^"]*\)"$/\1/'; }
json_assets() { grep -o '"browser_download_url"[[:space:]]*:[[:space:]]*"[^"]*"' | sed 's|.*/\([^/"]*\)"$|\1|'; }

download() { # url file
    local progress=--silent
    if [[ -t 2 ]]; then progress=--progress-bar; fi
    curl --fail --location --retry "$RETRIES" --retry-delay 2 --connect-timeout "$CONNECT_TIMEOUT_S" \
        --max-time "$DOWNLOAD_TIMEOUT_S" "$progress" --show-error --output "$2" "$1"
}

archive_kind() { # file display-name -> tar | zip
    local magic
    case $2 in
    *.zip) echo zip ;;
    *.tar.gz | *.tgz | *.tar | *.tar.xz | *.tar.bz2 | *.tar.zst) echo tar ;;
    *)
        magic=$(od -An -tx1 -N4 "$1" | tr -d ' \n')
        case $magic in
        504b0304) echo zip ;;
        1f8b*) echo tar ;;
        *) die "$2 is neither a .tar.gz nor a .zip archive" ;;
        esac
        ;;
    esac
}

# Zip has no portable symlinks: Info-ZIP unzip restores them only when the archive stored
# Unix modes and unzip was built with symlink support; other tools write the link target
# as a small text file. python3's zipfile gives full control: a member whose Unix mode
# (external_attr >> 16) is S_IFLNK (0o120000) becomes a symlink; other modes are kept.
extract_zip_python() { # zip dest
    python3 - "$1" "$2" <<'PY'
import os, shutil, stat, sys, zipfile

src, root = sys.argv[1], os.path.realpath(sys.argv[2])


def inside(path):
    return path == root or path.startswith(root + os.sep)


with zipfile.ZipFile(src) as zf:
    for info in zf.infolist():
        name = info.filename.replace("\\", "/")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if name.startswith("/") or ".." in parts:
            sys.exit(f"unsafe path in archive: {info.filename!r}")
        if not parts:
            continue
        target = os.path.join(root, *parts)
        parent = os.path.dirname(target)
        os.makedirs(parent, exist_ok=True)
        if not inside(os.path.realpath(parent)):
            sys.exit(f"unsafe path in archive (through a symlink): {info.filename!r}")
        if info.is_dir():
            os.makedirs(target, exist_ok=True)
            continue
        if os.path.lexists(target):
            os.remove(target)
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            link = zf.read(info).decode("utf-8")
            if os.path.isabs(link) or not inside(os.path.normpath(os.path.join(os.path.realpath(parent), link))):
                sys.exit(f"symlink leaves the archive: {info.filename!r} -> {link!r}")
            os.symlink(link, target)
            continue
        with zf.open(info) as s, open(target, "wb") as d:
            shutil.copyfileobj(s, d)
        if stat.S_IMODE(mode):
            os.chmod(target, stat.S_IMODE(mode))
PY
}

extract() { # archive stage-dir display-name
    local tool="" candidate
    if [[ $(archive_kind "$1" "$3") == tar ]]; then
        # GNU tar and bsdtar both restore symlinks and refuse absolute and ../ member names.
        tar --no-same-owner -xf "$1" -C "$2" || die "could not extract $3 (tar failed)"
        return 0
    fi
    if [[ -n ${MESHNET_FETCH_UNZIP:-} ]]; then
        tool=$MESHNET_FETCH_UNZIP
    else
        for candidate in python3 bsdtar unzip; do
            if command -v "$candidate" >/dev/null 2>&1; then
                tool=$candidate
                break
            fi
        done
    fi
    case $tool in
    python3) extract_zip_python "$1" "$2" || die "could not extract $3 (python3 zipfile failed)" ;;
    bsdtar) bsdtar -xf "$1" -C "$2" || die "could not extract $3 (bsdtar failed)" ;;
    unzip) unzip -q -o "$1" -d "$2" || die "could not extract $3 (unzip failed)" ;;
    "") die "cannot extract a .zip: install python3, bsdtar (libarchive-tools) or unzip" ;;
    *) die "MESHNET_FETCH_UNZIP=$tool: expected python3, bsdtar or unzip" ;;
    esac
    log "extracted the zip with $tool"
}

# Repair what extractors and upstream packaging are known to break:
#  - a symlink stored as a plain file holding its target's name (zip tools without
#    symlink support): a tiny lib*.so* or *.dylib whose one line names a sibling;
#  - dangling links like libggml.so -> llama-b9165ibggml.so.0 (ggml-org/llama.cpp#23115,
#    the packer's --transform also rewrote link targets): relinked to the one sibling
#    named as the target without its llama-b<N> prefix plus one leading character.
# Other dangling links are reported, not fatal (llama-server may not need them).
repair_links() { # root
    local f dir target rest m match count
    while IFS= read -r -d '' f; do
        if [[ $(wc -c <"$f") -ge 256 ]]; then continue; fi
        target=$(head -n 1 "$f" | tr -d '\r')
        dir=${f%/*}
        if [[ -n $target && $target != */* && $target != "${f##*/}" && -e $dir/$target ]] &&
            ! LC_ALL=C grep -q '[^[:print:]]' <<<"$target"; then
            ln -sfn "$target" "$f"
            log "restored symlink ${f#"$1"/} -> $target (the archive stored it as a text file)"
        fi
    done < <(find "$1" -type f \( -name 'lib*.so*' -o -name '*.dylib' \) -print0)

    while IFS= read -r -d '' f; do
        if [[ -e $f ]]; then continue; fi
        target=$(readlink "$f")
        dir=${f%/*}
        if [[ $target != */* && $target =~ ^llama-b[0-9]+(.+)$ ]]; then
            rest=${BASH_REMATCH[1]}
            count=0 match=""
            for m in "$dir"/?"$rest"; do
                if [[ -e $m && $m != "$f" ]]; then
                    count=$((count + 1))
                    match=${m##*/}
                fi
            done
            if [[ $count -eq 1 ]]; then
                ln -sfn "$match" "$f"
                log "repaired broken symlink ${f#"$1"/} -> $match (was -> $target)"
                continue
            fi
        fi
        log "warning: dangling symlink in the archive: ${f#"$1"/} -> $target"
    done < <(find "$1" -type l -print0)
}

find_server() { # root -> relative path of llama-server, shallowest first
    (cd "$1" && find . \( -type f -o -type l \) -name llama-server -print) |
        awk '{ print length($0) " " $0 }' | sort -n | head -n 1 | cut -d' ' -f2- | sed 's|^\./||'
}

# ---------------------------------------------------------------- plan
tag=$build
names=()
published=()
if [[ -n $archive ]]; then
    if [[ ! -f $archive || ! -r $archive ]]; then usage_error "--archive: no readable file at $archive"; fi
    archive="$(cd "$(dirname "$archive")" && pwd -P)/${archive##*/}"
    if [[ $tag == latest ]]; then
        tag=local
        if [[ ${archive##*/} =~ ^llama-([A-Za-z0-9._-]+)-bin- ]]; then tag=${BASH_REMATCH[1]}; fi
    fi
    if ((dry_run)); then
        log "dry run: would install $archive (build $tag) into ${dest:-$INSTALL_ROOT/$tag-$backend}"
        printf 'file://%s\n' "$archive"
        exit 0
    fi
else
    # The API is needed to resolve "latest", and for rocm to learn the ROCm version.
    need_api=$rocm_lookup
    if [[ $build == latest ]]; then need_api=1; fi
    if ((dry_run)); then
        shown=$build
        if ((need_api)); then
            api_url "$build"
            echo
            if [[ $build == latest ]]; then shown='<latest>'; fi
            log "dry run: the release's tag and asset list come from the API URL above"
        fi
        while IFS= read -r n; do names+=("$n"); done < <(candidate_assets "$shown")
        if ((rocm_lookup)); then
            log "dry run: the ROCm version is read from the asset list" \
                "(shown: ${ROCM_VERSIONS_GUESS[0]}; pin with --rocm-version)"
        fi
        if [[ ${#names[@]} -gt 1 ]]; then log "dry run: if that asset is missing, next tried: ${names[1]}"; fi
        log "dry run: would install into ${dest:-$INSTALL_ROOT/$shown-$backend}"
        download_url "$shown" "${names[0]}"
        echo
        exit 0
    fi
    command -v curl >/dev/null 2>&1 || die "curl is required to download"

    if ((need_api)); then
        url=$(api_url "$build")
        log "asking $url"
        if json=$(fetch_api "$url"); then
            tag=$(json_tag <<<"$json")
            if [[ -z $tag ]]; then die "no tag_name in the answer from $url"; fi
            while IFS= read -r n; do published+=("$n"); done < <(json_assets <<<"$json")
        elif [[ $build == latest ]]; then
            die "could not read the latest release from $url;" \
                "pass an explicit BUILD (e.g. b6500), see $GITHUB/$REPO/releases"
        else
            log "warning: could not read the asset list; guessing asset names"
        fi
    fi

    if [[ ${#published[@]} -gt 0 ]]; then
        if ((rocm_lookup)); then
            while IFS= read -r n; do names+=("$n"); done < <(printf '%s\n' "${published[@]}" | pick_rocm_assets "$tag")
        else
            while IFS= read -r n; do
                if printf '%s\n' "${published[@]}" | grep -Fxq -- "$n"; then names+=("$n"); fi
            done < <(candidate_assets "$tag")
        fi
        if [[ ${#names[@]} -eq 0 ]]; then
            os_word=ubuntu
            if [[ $backend == macos ]]; then os_word=macos; fi
            log "release $tag has no asset named $(candidate_assets "$tag" | head -n 1); its $os_word assets are:"
            printf '%s\n' "${published[@]}" | grep -F -- "-$os_word-" | sed 's/^/    /' >&2 || true
            die "choose one with --asset NAME (see $GITHUB/$REPO/releases/tag/$tag)"
        fi
    else
        while IFS= read -r n; do names+=("$n"); done < <(candidate_assets "$tag")
    fi
fi

if [[ -z $dest ]]; then dest="$INSTALL_ROOT/$tag-$backend"; fi
mkdir -p "$(dirname "$dest")" || die "cannot create $(dirname "$dest")"
dest_parent=$(cd "$(dirname "$dest")" && pwd -P)
dest="$dest_parent/${dest##*/}"

# Reuse a finished install of the same build (downloads only; --archive always installs).
if [[ -z $archive && $force -eq 0 && -f $dest/$MARKER ]]; then
    rel=$(sed -n 's/^binary=//p' "$dest/$MARKER")
    old_sha=$(sed -n 's/^sha256=//p' "$dest/$MARKER")
    if [[ -n $rel && -x $dest/$rel ]] && [[ -z $sha256 || $old_sha == "$sha256" ]]; then
        log "already installed: $dest (--force fetches it again)"
        printf '%s\n' "$dest/$rel"
        exit 0
    fi
fi
if [[ -L $dest || (-e $dest && ! -f $dest/$MARKER) ]] && [[ -n $(ls -A "$dest" 2>/dev/null || echo not-a-dir) ]]; then
    die "refusing to replace $dest: it exists and was not made by this script (no $MARKER);" \
        "remove it or pass another --dest"
fi

# ---------------------------------------------------------------- fetch and unpack
work=$(mktemp -d "$dest_parent/.fetch-llama.XXXXXX")
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

url=""
if [[ -n $archive ]]; then
    file=$archive
    asset=${archive##*/}
else
    file="" asset="" tried=""
    for name in "${names[@]}"; do
        url=$(download_url "$tag" "$name")
        tried="$tried    $url"$'\n'
        log "downloading $url"
        if download "$url" "$work/$name"; then
            file="$work/$name" asset=$name
            break
        fi
        rm -f "$work/$name"
    done
    if [[ -z $file ]]; then
        printf '%s: tried:\n%s' "$PROG" "$tried" >&2
        die "download failed; check $GITHUB/$REPO/releases/tag/$tag for the asset name and pass --asset NAME"
    fi
fi

if [[ ! -s $file ]]; then die "$asset is empty"; fi
log "$asset: $(wc -c <"$file" | tr -d ' ') bytes"
actual_sha=$(sha256_of "$file")
if [[ -n $sha256 ]]; then
    if [[ $actual_sha != "$sha256" ]]; then die "SHA-256 mismatch for $asset: expected $sha256, got $actual_sha"; fi
    log "SHA-256 verified"
else
    log "sha256 $actual_sha (pin it with --sha256)"
fi

stage="$work/stage"
mkdir "$stage"
extract "$file" "$stage" "$asset"

# Flatten a single top-level folder (llama-<tag>/ in current assets, build/ in old zips).
root=$stage
entries=$(ls -A "$stage")
if [[ -n $entries && $entries != *$'\n'* && -d $stage/$entries && ! -L $stage/$entries ]]; then
    root="$stage/$entries"
fi

repair_links "$root"
rel=$(find_server "$root")
if [[ -z $rel ]]; then
    log "$asset contains no llama-server; it holds:"
    (cd "$root" && find . -maxdepth 3 | head -n 20 | sed 's/^/    /') >&2
    die "not a llama.cpp server build: $asset"
fi
chmod +x "$root/$rel" # follows a symlink to its target
if [[ ! -x $root/$rel || ! -e $root/$rel ]]; then die "llama-server in $asset is not usable (dangling link?)"; fi

cat >"$root/$MARKER" <<MARK
asset=$asset
build=$tag
backend=$backend
arch=$arch
sha256=$actual_sha
binary=$rel
url=${url:-file://$file}
MARK

if [[ -e $dest || -L $dest ]]; then rm -rf "$dest"; fi
mv "$root" "$dest"
log "installed $asset into $dest"
printf '%s\n' "$dest/$rel"
