"""The live fleet page: ``GET /fleet`` (one self-contained HTML page) reads ``GET /fleet.json``
(``fleet_view``) every second and redraws: every server with its address, health, weight
version, load, sessions and adapters; the last weight updates with their phases; the fleet's
recent events (servers lost and back, migrations). No build step and nothing fetched from
elsewhere: it works on a cluster without internet access."""

from __future__ import annotations

FLEET_HTML = b"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>skyrl-grpc fleet</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
 h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin-top: 1.6em; }
 table { border-collapse: collapse; }
 th, td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: left; }
 th { background: #f4f4f4; }
 .healthy { color: #137333; } .unhealthy, .unknown, .lost { color: #b3261e; }
 .draining { color: #a56a00; } #stale { color: #b3261e; }
 code { font-size: 0.95em; }
</style>
</head>
<body>
<h1>skyrl-grpc fleet <span id="replica"></span></h1>
<div>updated <span id="updated">never</span> <span id="stale"></span></div>
<h2>Servers</h2>
<table id="servers">
 <thead><tr><th>server</th><th>health</th><th>weight version</th><th>running</th>
 <th>waiting</th><th>KV cache</th><th>in flight</th><th>sessions</th><th>adapters</th>
 <th>seed</th></tr></thead>
 <tbody></tbody>
</table>
<h2>Last weight updates</h2>
<table id="updates">
 <thead><tr><th>ended</th><th>server</th><th>version</th><th>outcome</th><th>phases (s)</th>
 <th>bytes</th></tr></thead>
 <tbody></tbody>
</table>
<h2>Events</h2>
<table id="events">
 <thead><tr><th>when</th><th>event</th><th>server</th><th>detail</th></tr></thead>
 <tbody></tbody>
</table>
<script>
"use strict";
function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}
function when(seconds) { return new Date(seconds * 1000).toLocaleTimeString(); }
function fill(id, rows) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...rows);
}
function draw(fleet) {
  document.getElementById("replica").textContent =
    fleet.replica === null ? "" : "(router replica " + fleet.replica + ")";
  fill("servers", fleet.servers.map(s => {
    const row = document.createElement("tr");
    row.dataset.server = s.address;
    cell(row, s.address).innerHTML = "<code></code>";
    row.firstChild.firstChild.textContent = s.address;
    let health = s.draining ? "draining" : (s.paused && s.healthy ? "paused" : s.state);
    if (s.standby) health += " (standby)";  // kept current, given no traffic
    cell(row, health, "state " + s.state);
    cell(row, String(s.weight_version), "version");
    cell(row, String(s.running), "running");
    cell(row, String(s.waiting), "waiting");
    cell(row, (100 * s.kv_cache_usage).toFixed(1) + "%");
    cell(row, String(s.in_flight));
    cell(row, String(s.live_sessions), "sessions");
    cell(row, s.adapters.join(", ") || "-", "adapters");
    cell(row, s.sampling_seed === null ? "-" : String(s.sampling_seed), "seed");
    return row;
  }));
  const updates = fleet.servers.flatMap(s => s.recent_updates.map(u => [s.address, u]));
  updates.sort((a, b) => b[1].ended_at - a[1].ended_at);
  fill("updates", updates.slice(0, 20).map(([server, u]) => {
    const row = document.createElement("tr");
    row.dataset.server = server;
    row.dataset.version = u.weight_version;
    cell(row, when(u.ended_at));
    cell(row, server);
    cell(row, String(u.weight_version), "version");
    cell(row, u.outcome, "outcome");
    cell(row, Object.entries(u.phase_seconds).map(([k, v]) => k + " " + v.toFixed(3)).join(", "),
         "phases");
    cell(row, String(u.bytes));
    return row;
  }));
  fill("events", fleet.events.slice().reverse().map(e => {
    const row = document.createElement("tr");
    row.dataset.server = e.server;
    row.dataset.kind = e.kind;
    cell(row, when(e.at));
    cell(row, e.kind, "kind " + e.kind);
    cell(row, e.server);
    cell(row, e.detail);
    return row;
  }));
  document.getElementById("updated").textContent = when(fleet.now);
}
async function poll() {
  try {
    const answer = await fetch("fleet.json", {cache: "no-store"});
    if (!answer.ok) throw new Error("HTTP " + answer.status);
    draw(await answer.json());
    document.getElementById("stale").textContent = "";
  } catch (error) {
    document.getElementById("stale").textContent = "(router unreachable: " + error + ")";
  }
  setTimeout(poll, 1000);
}
poll();
</script>
</body>
</html>
"""
