// The node's status page: polls /status.json and fills the page in. Text only (no HTML from data).
"use strict";

const KEY_STORE = "meshnet-api-key";
const DEFAULT_POLL_MS = 1000;
let pollMs = DEFAULT_POLL_MS;
let timer = null;

const $ = (id) => document.getElementById(id);
const set = (id, text) => { $(id).textContent = text; };
const num = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en"));

function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${Math.floor(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

// The state an operator reads: llama-server's warm-up is part of "loading" on the wire.
function shownState(h) {
  if (h.state === "loading" && /warm/.test(h.detail || "")) return "warming up";
  return h.state;
}

// The node's own figures, measured after warm-up: "prefill 1200 tok/s @ 32, 900 @ 512 · decode 40 tok/s @ 32".
function capabilityText(c) {
  if (!c || !c.prefill_tokens_per_s.length) return "not measured";
  const rates = (points, digits) => points.map((p) => `${p.tokens_per_s.toFixed(digits)} @ ${p.ctx_tokens}`).join(", ");
  return `prefill ${rates(c.prefill_tokens_per_s, 0)} tok/s · decode ${rates(c.decode_tokens_per_s, 1)} tok/s (@ prompt tokens)`;
}

// Which installed llama-server serves, why, and each one's figures (llama/speed_choice.BinaryChoice.to_dict).
function choiceText(choice) {
  if (!choice) return "–";
  const each = (choice.candidates || []).map((c) => {
    const mark = c.path === choice.chosen ? "chosen" : "other";
    const figures = c.expected_request_s === null
      ? `not measured: ${c.not_measured}`
      : `a typical request ${c.expected_request_s.toFixed(2)} s (${capabilityText(c.capability)})`;
    return `${mark}: ${c.path} — ${figures}`;
  });
  return [choice.how, ...each].join(" · ");
}

function render(doc) {
  const h = doc.health;
  $("login").hidden = true;
  $("problem").hidden = true;
  $("status").hidden = false;
  set("model", h.model || "");
  const state = shownState(h);
  set("state", state);
  $("state").dataset.state = state;
  set("detail", h.detail || (state === "ready" ? "Serving requests." : ""));
  const loading = ["starting", "loading", "restarting"].includes(h.state);
  $("load").hidden = !loading;
  if (loading) {
    const fraction = h.load_progress;
    if (fraction === null || fraction === undefined) {
      $("load-progress").removeAttribute("value");  // indeterminate: nothing measurable yet
      set("load-percent", "");
    } else {
      $("load-progress").value = fraction;
      set("load-percent", `${Math.round(fraction * 100)}%`);
    }
  }
  set("plan", doc.plan || "–");
  set("llama-server", doc.llama_server || "–");
  set("llama-server-choice", choiceText(doc.llama_server_choice));
  set("quant", h.quant || "–");
  set("slots", `${h.slots_busy} / ${h.slots_total}`);
  set("speed", h.recent_tokens_per_s ? `${h.recent_tokens_per_s.toFixed(1)} tokens/s (last minute)` : "no requests in the last minute");
  set("capability", capabilityText(h.capability));
  set("uptime", duration(h.uptime_s));
  set("restarts", num(h.restarts));
  set("versions", `node ${h.node_version || "?"}, llama-server ${h.llama_build || "?"}`);

  if (doc.tracker) {
    set("tracker", h.mesh_problem ? `${doc.tracker} — not online: ${h.mesh_problem}` : `${doc.tracker} — linked`);
  } else {
    set("tracker", "none (standalone)");
  }
  const r = h.relay;
  if (r) {
    const why = r.state === "attached" ? `, ${r.streams_active} stream(s) now, ${num(r.streams_total)} in all` : (r.last_error ? ` — ${r.last_error}` : "");
    set("relay", `${r.url}: ${r.state}${why}`);
  } else {
    set("relay", "none (reached directly)");
  }
  $("chat-link").hidden = !doc.chat;

  const u = h.usage;
  set("requests", num(u.requests));
  set("prompt-tokens", `${num(u.prompt_tokens)} (${num(u.cached_tokens)} from cache)`);
  set("completion-tokens", num(u.completion_tokens));
  set("errors", `${num(u.errors)} / ${num(u.cancelled)}`);

  // A node of several models: each one's state (the first stays loaded; the others come and go).
  const models = doc.models || [];
  $("models-card").hidden = models.length < 2;
  if (models.length > 1) {
    $("models").replaceChildren(...models.map((m) => {
      const tr = document.createElement("tr");
      const state = m.pinned ? `${m.state} (kept loaded)` : m.state;
      const cells = [
        m.alias, m.error ? `${state}: ${m.error.split("\n")[0]}` : state,
        m.rss_bytes ? `${(m.rss_bytes / 2 ** 20).toFixed(0)} MiB` : "–",
        m.idle_s === null || m.idle_s === undefined ? "–" : duration(m.idle_s), num(m.requests || 0), m.loads === null ? "–" : num(m.loads),
      ];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (i === 1) td.className = `model-${m.state}`;
        tr.appendChild(td);
      });
      return tr;
    }));
  }

  const body = $("recent");
  const rows = doc.recent_requests.map((q) => {
    const tr = document.createElement("tr");
    const cells = [
      q.request_id, q.route, `${num(q.prompt_tokens)} / ${num(q.completion_tokens)}`, duration(q.ttft_s),
      q.decode_tokens_per_s ? q.decode_tokens_per_s.toFixed(1) : "–", `${q.outcome} (${q.status})`,
    ];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (i === 0) td.className = "id";
      if (i === 5) td.className = `outcome-${q.outcome}`;
      tr.appendChild(td);
    });
    return tr;
  });
  if (rows.length) body.replaceChildren(...rows);
  set("updated", new Date().toLocaleTimeString());
  if (doc.poll_interval_s) pollMs = doc.poll_interval_s * 1000;
}

function showLogin(why) {
  $("status").hidden = true;
  $("login").hidden = false;
  set("login-why", why);
  set("state", "locked");
  $("state").dataset.state = "unknown";
}

function showProblem(text) {
  $("problem").hidden = false;
  set("problem", text);
}

async function poll() {
  const key = sessionStorage.getItem(KEY_STORE);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const response = await fetch("status.json", { headers, cache: "no-store" });
    if (response.status === 401) {
      showLogin(key ? "That key was refused; try again." : "This node asks for its API key.");
      return;  // no polling until a key is given
    }
    if (!response.ok) {
      let message = `status.json answered ${response.status}`;
      try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
      showProblem(message);
    } else {
      render(await response.json());
    }
  } catch (e) {
    showProblem("The node is not answering (stopped or restarting?); still trying.");
  }
  timer = setTimeout(poll, pollMs);
}

$("login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("api-key").value);
  $("api-key").value = "";
  clearTimeout(timer);
  poll();
});

poll();
