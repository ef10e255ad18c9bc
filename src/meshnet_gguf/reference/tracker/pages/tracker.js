// The tracker's page: polls /dashboard.json and fills the tables. Text only (no HTML from data).
"use strict";

let pollMs = 2000;
const $ = (id) => document.getElementById(id);
const short = (id) => (id && id.length > 14 ? `${id.slice(0, 12)}…` : id || "–");
// A missing figure is said in words (the legend under each table says what each column means), never "?".
const pair = (c) => `${c.prompt_tokens ?? 0} / ${c.completion_tokens ?? 0}`;
const AGREEMENT_WORDS = { agree: "agree", mismatch: "DISAGREES", awaiting_receipt: "awaiting receipt", unmetered: "not metered yet" };

function trackerCounted(u) {
  const ceiling = u.ceiling ? `ceiling: at most ${u.ceiling.prompt_tokens} prompt / ${u.ceiling.completion_tokens} completion tokens` : "no ceiling yet";
  if (u.outcome === "in_flight") return ["counting…", "muted", ceiling];
  if (u.outcome === "refused") return ["nothing (refused)", "muted", ceiling];
  if (!u.stream) return ["no stream: bounded by its text", "muted", ceiling];
  return [`${u.tracker.completion_tokens ?? 0} token events`, "", ceiling];
}

function nodeSigned(u) {
  if (u.node) return [pair(u.node), "", u.node_finish_reason ? `finish reason: ${u.node_finish_reason}` : ""];
  return [u.outcome === "refused" ? "none needed" : "no receipt yet", "muted"];
}

function agreementCell(u) {
  const words = AGREEMENT_WORDS[u.agreement] ?? u.agreement;
  if (!u.flagged) return [words];
  // Flagged: the receipt claims more than the ceiling, or the tracker stopped mid-forward.
  return [u.outcome === "interrupted" ? `FLAGGED: interrupted, ${words}` : `DISAGREES (${words})`, "flag"];
}

function billed(u) {
  if (u.billed) return [pair(u.billed)];
  if (u.outcome === "in_flight") return ["not yet (in flight)", "muted"];
  return [u.node ? "not yet (no ceiling)" : "not yet (no receipt)", "muted"];
}

// Claimed (the node's own start-up figures) beside measured (what this tracker timed), in tokens/s.
function speedText(s) {
  if (!s) return "–";
  const rate = (v) => (v === null || v === undefined ? "–" : v.toFixed(0));
  const claimed = `prefill ${rate(s.claimed_prefill_tokens_per_s)}, decode ${rate(s.claimed_decode_tokens_per_s)}`;
  const measured = s.measured_streams
    ? `prefill ${rate(s.measured_prefill_tokens_per_s)}, decode ${rate(s.measured_decode_tokens_per_s)} over ${s.measured_streams} stream(s)`
    : "not yet";
  return `${claimed} / ${measured}${s.claim_flagged ? " — CLAIM FLAGGED: far above what it delivers" : ""}`;
}

// What the node got: its share of its model's last requests, and what it was billed for here.
function shareCell(r) {
  if (!r || !r.of_last) return ["no request yet", "muted"];
  return [`${Math.round(r.share * 100)} % (${r.requests} of the last ${r.of_last})`];
}

function earnedCell(e) {
  if (!e || !e.requests) return ["nothing billed yet", "muted"];
  const n = (v) => v.toLocaleString("en");
  return [`${n(e.requests)} request(s): ${n(e.prompt_tokens)} prompt + ${n(e.completion_tokens)} completion tokens`];
}

// Proof of model, in words: a node's audits on this tracker (null: no verifier audits its model).
function auditCell(a) {
  if (!a) return ["not audited", "muted", "no verifier is named for this model on this tracker"];
  const last = a.last_verdict ? `latest: ${a.last_verdict.outcome}, ${a.last_verdict.reason}` : "no verdict yet";
  const pending = a.pending ? `, ${a.pending} pending` : "";
  if (a.failed) return [`FAILED ${a.failed}, passed ${a.passed}${pending}: not routed`, "flag", last];
  if (a.proof_blocked) return [`probing: ${a.passed} passed${pending}`, "muted", last];
  if (!a.passed && !a.pending) return ["none audited yet", "muted", last];
  return [`${a.passed} passed${pending}`, "", last];
}

// Every model the node serves and its state there: loaded, loadable (with its expected load), loading, unavailable.
function modelState(m) {
  if (m.state === "loaded") return "loaded";
  if (m.state === "unavailable") return "unavailable";
  // cold_load_s is what the tracker counts: the node's expected load, or the load it saw if longer.
  const load = m.expected_load_s != null || m.seen_load_s != null ? `~${m.cold_load_s.toFixed(1)} s load` : "load time not measured";
  return m.loading ? `loading (${m.cold_load_s.toFixed(1)} s left)` : `loadable, ${load}`;
}

function modelsCell(n) {
  const first = n.quant ? `${n.model} (${n.quant})` : n.model;
  if (!n.models || n.models.length <= 1) return [first];
  const text = n.models.map((m) => `${m.model}: ${modelState(m)}`).join("; ");
  return [text, "", `${n.models.length} models; the first is ${first}`];
}

function row(cells, className) {
  const tr = document.createElement("tr");
  if (className) tr.className = className;
  for (const [text, cls, title] of cells) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    if (title) td.title = title;
    tr.appendChild(td);
  }
  return tr;
}

function render(doc) {
  $("problem").hidden = true;
  const online = doc.nodes.filter((n) => n.state === "online").length;
  $("summary").textContent = `${doc.nodes.length} node(s), ${online} online`;
  const nodes = doc.nodes.map((n) => row([
    [short(n.node_id), "id", n.node_id],
    modelsCell(n),
    [n.node_state && n.node_state !== "ready" ? `${n.state} (node: ${n.node_state})` : n.state, `state-${n.state}`],
    [`${n.slots_busy} / ${n.slots_total}`],
    [n.tokens_per_s ? n.tokens_per_s.toFixed(1) : "–"],
    [speedText(n.speed), n.speed && n.speed.claim_flagged ? "flag" : ""],
    shareCell(n.recent_share),
    earnedCell(n.earned),
    [n.reached === "relayed" ? `relayed via ${n.relay_url}` : `direct ${n.advertised_url}`],
    [`${n.last_seen_s_ago} s ago${n.health_misses ? `, ${n.health_misses} missed` : ""}`],
    [String(n.routed)],
    auditCell(n.audits),
  ]));
  $("nodes").replaceChildren(...(nodes.length ? nodes : [row([["no node has registered yet", "muted"]])]));
  const routes = doc.recent_routes.map((u) => row([
    [short(u.request_id), "id", u.request_id],
    [short(u.node_id), "id", u.node_id],
    [u.model],
    [u.status ? `${u.outcome} (${u.status})` : u.outcome === "in_flight" ? "in flight" : `${u.outcome} (no answer)`],
    trackerCounted(u),
    nodeSigned(u),
    billed(u),
    agreementCell(u),
  ], u.flagged ? "flagged" : ""));
  $("routes").replaceChildren(...(routes.length ? routes : [row([["nothing routed yet", "muted"]])]));
  $("disagreements").textContent = doc.disagreements ? `— ${doc.disagreements} disagreement(s) flagged` : "— counts agree";
  $("updated").textContent = new Date().toLocaleTimeString();
  if (doc.poll_interval_s) pollMs = doc.poll_interval_s * 1000;
}

async function poll() {
  try {
    const response = await fetch("dashboard.json", { cache: "no-store" });
    if (!response.ok) throw new Error(`dashboard.json answered ${response.status}`);
    render(await response.json());
  } catch (e) {
    $("problem").hidden = false;
    $("problem").textContent = `The tracker is not answering (${e.message}); still trying.`;
  }
  setTimeout(poll, pollMs);
}

poll();
