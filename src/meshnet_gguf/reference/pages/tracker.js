// The tracker's page: polls /dashboard.json and fills the tables. Text only (no HTML from data).
"use strict";

let pollMs = 2000;
const $ = (id) => document.getElementById(id);
const short = (id) => (id && id.length > 14 ? `${id.slice(0, 12)}…` : id || "–");
const counts = (c) => (c ? `${c.prompt_tokens ?? "?"} / ${c.completion_tokens ?? "?"}` : "–");

// Claimed (the node's own start-up figures) beside measured (what this tracker timed), in tokens/s.
function speedText(s) {
  if (!s) return "–";
  const rate = (v) => (v === null || v === undefined ? "?" : v.toFixed(0));
  const claimed = `prefill ${rate(s.claimed_prefill_tokens_per_s)}, decode ${rate(s.claimed_decode_tokens_per_s)}`;
  const measured = s.measured_streams
    ? `prefill ${rate(s.measured_prefill_tokens_per_s)}, decode ${rate(s.measured_decode_tokens_per_s)} over ${s.measured_streams} stream(s)`
    : "not yet";
  return `${claimed} / ${measured}${s.claim_flagged ? " — CLAIM FLAGGED: far above what it delivers" : ""}`;
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
    [n.quant ? `${n.model} (${n.quant})` : n.model],
    [n.node_state && n.node_state !== "ready" ? `${n.state} (node: ${n.node_state})` : n.state, `state-${n.state}`],
    [`${n.slots_busy} / ${n.slots_total}`],
    [n.tokens_per_s ? n.tokens_per_s.toFixed(1) : "–"],
    [speedText(n.speed), n.speed && n.speed.claim_flagged ? "flag" : ""],
    [n.reached === "relayed" ? `relayed via ${n.relay_url}` : `direct ${n.advertised_url}`],
    [`${n.last_seen_s_ago} s ago${n.health_misses ? `, ${n.health_misses} missed` : ""}`],
    [String(n.routed)],
  ]));
  $("nodes").replaceChildren(...(nodes.length ? nodes : [row([["no node has registered yet", "muted"]])]));
  const routes = doc.recent_routes.map((u) => row([
    [short(u.request_id), "id", u.request_id],
    [short(u.node_id), "id", u.node_id],
    [u.model],
    [`${u.outcome ?? "?"} (${u.status ?? "–"})`],
    [counts(u.tracker)],
    [counts(u.node)],
    [counts(u.billed)],
    [u.flagged ? `DISAGREES (${u.agreement})` : u.agreement, u.flagged ? "flag" : ""],
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
