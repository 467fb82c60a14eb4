// quill's live dashboard: polls /status.json and /history.json every second and
// /clients.json every five, draws the servers, a traffic chart and the recent clients.
// Buttons (blacklist / whitelist, drain / undrain) POST one command line to /control (with the X-Quill-Control header the server
// requires); they are shown only when GET /control says control_acl permits this viewer.
"use strict";

const BLACKLIST_SECONDS = 3600;
const SVG = "http://www.w3.org/2000/svg";

let canControl = false;
let lastStatus = null; // { at: ms, servers: Map index -> total_connections }
const serverRates = new Map();

const $ = (id) => document.getElementById(id);

function fmtInt(n) {
  return Number(n).toLocaleString("en-US");
}

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

function fmtRate(n) {
  return n >= 100 ? n.toFixed(0) : n >= 10 ? n.toFixed(1) : n.toFixed(2);
}

function fmtDuration(s) {
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

async function getJson(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

function setLive(ok) {
  $("live").classList.toggle("stale", !ok);
  $("live-text").textContent = ok ? "live" : "no answer";
}

// ---- servers -------------------------------------------------------------

function stateLabel(s) {
  if (s.state === "blacklisted" && s.blacklist_seconds_left > 0) {
    return "blacklisted · " + fmtDuration(s.blacklist_seconds_left);
  }
  return s.state;
}

function loadCell(s, busiest) {
  const limit = s.max > 0 ? s.max : 0;
  const frac = limit > 0 ? s.connections / limit : busiest > 0 ? s.connections / busiest : 0;
  const fill = el("span");
  fill.style.width = Math.min(100, Math.round(frac * 100)) + "%";
  const label = limit > 0 ? s.connections + " of " + limit : s.connections + " open";
  return el("td", { class: "load" }, el("div", { class: "bar" }, fill), el("div", { class: "bar-label" }, label));
}

function button(label, action, title, line, danger) {
  const b = el("button", { class: danger ? "danger" : "", "data-action": action, title }, label);
  b.addEventListener("click", () => control(line, b));
  return b;
}

function actionsCell(s) {
  const td = el("td", { class: "actions" });
  if (!canControl) return td;
  const n = s.index;
  if (s.blacklisted ?? s.state === "blacklisted") {
    td.append(button("Whitelist", "whitelist", "Send traffic to this server again", "server " + n + " blacklist 0"));
  } else {
    td.append(button("Blacklist", "blacklist",
      "Send no new connections to this server for one hour (Whitelist undoes it)",
      "server " + n + " blacklist " + BLACKLIST_SECONDS, true));
  }
  if (s.draining === true) {
    td.append(button("Undrain", "undrain", "Accept new connections again", "server " + n + " drain 0"));
  } else if (s.draining === false) {
    td.append(button("Drain", "drain",
      "No new connections; open ones finish (Undrain undoes it)", "server " + n + " drain"));
  }
  return td;
}

// Open connections, and the clients waiting for room when the server is at its max
// (queue_timeout).
function connectionsCell(s) {
  const td = el("td", { class: "num" }, fmtInt(s.connections));
  if (s.queued > 0) td.append(el("div", { class: "bar-label" }, fmtInt(s.queued) + " waiting"));
  return td;
}

// Failed connects, and with http the server's 5xx answers and the requests its clients
// left before the answer had ended: each shown once there are any.
function failuresCell(s) {
  const td = el("td", { class: "num" }, fmtInt(s.failures));
  const answers = [[s.responses ? s.responses["5xx"] : 0, " 5xx"], [s.client_aborts, " left"]]
    .filter(([n]) => n > 0);
  if (answers.length > 0) {
    td.append(el("div", { class: "bar-label" }, answers.map(([n, what]) => fmtInt(n) + what).join(" · ")));
  }
  return td;
}

function stateCell(s) {
  const td = el("td", { class: "state" }, el("span", { class: "badge " + s.state }, stateLabel(s)));
  if (s.health_check) {
    td.append(el("div", { class: "bar-label" }, "check " + s.health_check + ": " + s.health));
  }
  return td;
}

function renderServers(status) {
  const now = Date.now();
  if (lastStatus) {
    const dt = (now - lastStatus.at) / 1000;
    for (const s of status.servers) {
      const before = lastStatus.servers.get(s.index);
      if (before !== undefined && dt > 0) serverRates.set(s.index, Math.max(0, (s.total_connections - before) / dt));
    }
  }
  lastStatus = { at: now, servers: new Map(status.servers.map((s) => [s.index, s.total_connections])) };

  const busiest = Math.max(1, ...status.servers.map((s) => s.connections));
  const rows = status.servers.map((s) =>
    el("tr", { "data-server": String(s.index), "data-state": s.state },
      el("td", {}, String(s.index)),
      el("td", { class: "mono" }, (s.host && s.host !== s.address ? s.host + " · " : "") + hostPort(s.address, s.port)),
      stateCell(s),
      loadCell(s, busiest),
      connectionsCell(s),
      el("td", { class: "num rate" }, serverRates.has(s.index) ? fmtRate(serverRates.get(s.index)) : "–"),
      el("td", { class: "num total" }, fmtInt(s.total_connections)),
      failuresCell(s),
      el("td", { class: "num" }, fmtBytes(s.bytes_to_server)),
      el("td", { class: "num" }, fmtBytes(s.bytes_from_server)),
      actionsCell(s)));
  const body = $("servers").tBodies[0];
  if (rows.length === 0) {
    body.replaceChildren(el("tr", { class: "empty-row" }, el("td", { colSpan: 11 }, "No servers configured")));
  } else {
    body.replaceChildren(...rows);
  }
}

function hostPort(address, port) {
  return address.includes(":") ? "[" + address + "]:" + port : address + ":" + port;
}

function renderSummary(status) {
  const c = status.connections;
  $("c-open").textContent = fmtInt(c.open);
  // Waiting for a server at its max (queue_timeout), those whose wait ran out, those not
  // let wait (queue_max) and those whose client left while waiting: shown once there are any.
  const queue = [[c.queued, " waiting"], [c.queue_timeouts, " timed out"], [c.queue_full, " queue full"],
    [c.queue_abandoned, " left"]];
  $("c-open-why").textContent = queue.some(([n]) => n > 0)
    ? queue.map(([n, what]) => fmtInt(n) + what).join(" · ")
    : "";
  $("c-accepted").textContent = fmtInt(c.accepted);
  const refused = c.refused_acl + c.refused_conn_max + c.no_server;
  $("c-refused").textContent = fmtInt(refused);
  $("c-refused-why").textContent = refused > 0
    ? "ACL " + fmtInt(c.refused_acl) + " · limit " + fmtInt(c.refused_conn_max) + " · no server " + fmtInt(c.no_server)
    : "";
  $("c-clients").textContent = fmtInt(status.clients.tracked);
  const m = status.mode;
  const mode = ["roundrobin", "hash", "weight", "prio", "stubborn"].filter((k) => m[k]);
  $("meta").textContent = "v" + status.version + " · listening on " + (status.listen || "?") +
    " · pid " + status.pid + " · up " + fmtDuration(status.uptime_seconds) +
    " · " + (mode.length ? mode.join(", ") : "client tracking");
}

// ---- chart ---------------------------------------------------------------

function renderChart(history) {
  const svg = $("chart");
  // Drawn at the element's own size, so text is never stretched.
  const W = Math.max(300, Math.round(svg.getBoundingClientRect().width) || 900);
  const H = 220, left = 44, right = 44, top = 12, bottom = 24;
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  const s = history.samples;
  const points = [];
  for (let i = 1; i < s.length; i++) {
    const dt = (s[i][0] - s[i - 1][0]) / 1000;
    if (dt <= 0) continue;
    points.push({ at: s[i][0], rate: Math.max(0, (s[i][1] - s[i - 1][1]) / dt), open: s[i][2] });
  }
  if (points.length > 0) {
    const last = points[points.length - 1];
    $("c-rate").textContent = fmtRate(last.rate);
    const i = s.length - 1;
    const dt = (s[i][0] - s[i - 1][0]) / 1000;
    const bytes = (s[i][3] - s[i - 1][3] + s[i][4] - s[i - 1][4]) / dt;
    $("c-bytes").textContent = fmtBytes(Math.max(0, bytes)) + "/s";
  }
  const children = [];
  const end = points.length ? points[points.length - 1].at : Date.now();
  // The window is the history there is (at least a minute, at most the five kept), so a
  // freshly started quill fills the chart instead of a sliver at its right edge.
  const have = points.length ? end - points[0].at : 0;
  const span = Math.min(300, Math.max(60, Math.ceil(have / 60000) * 60)) * 1000;
  const x = (at) => left + (W - left - right) * (1 - (end - at) / span);
  const maxRate = niceMax(Math.max(1, ...points.map((p) => p.rate)));
  const maxOpen = niceMax(Math.max(4, ...points.map((p) => p.open)));
  const yRate = (v) => top + (H - top - bottom) * (1 - v / maxRate);
  const yOpen = (v) => top + (H - top - bottom) * (1 - v / maxOpen);
  for (let k = 0; k <= 4; k++) {
    const y = top + (H - top - bottom) * (k / 4);
    children.push(svgEl("line", { class: "gridline", x1: left, x2: W - right, y1: y, y2: y }));
    children.push(svgEl("text", { class: "axis", x: left - 6, y: y + 4, "text-anchor": "end" }, fmtAxis(maxRate * (1 - k / 4))));
    children.push(svgEl("text", { class: "axis", x: W - right + 6, y: y + 4, "text-anchor": "start" }, fmtAxis(maxOpen * (1 - k / 4))));
  }
  const tick = span <= 60000 ? 10 : span <= 120000 ? 20 : 60;
  for (let sec = span / 1000; sec >= 0; sec -= tick) {
    const label = sec === 0 ? "now" : sec % 60 === 0 ? "−" + sec / 60 + " min" : "−" + sec + " s";
    children.push(svgEl("text", { class: "axis", x: x(end - sec * 1000), y: H - 6, "text-anchor": "middle" }, label));
  }
  if (points.length < 2) {
    children.push(svgEl("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "collecting samples…"));
  } else {
    const rate = points.map((p) => x(p.at).toFixed(1) + "," + yRate(p.rate).toFixed(1));
    const base = yRate(0).toFixed(1);
    children.push(svgEl("path", {
      class: "rate-area",
      d: "M" + x(points[0].at).toFixed(1) + "," + base + " L" + rate.join(" L") + " L" + x(points[points.length - 1].at).toFixed(1) + "," + base + " Z",
    }));
    children.push(svgEl("path", { class: "rate-line", d: "M" + rate.join(" L") }));
    const open = points.map((p) => x(p.at).toFixed(1) + "," + yOpen(p.open).toFixed(1));
    children.push(svgEl("path", { class: "open-line", d: "M" + open.join(" L") }));
  }
  svg.replaceChildren(...children);
}

function niceMax(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function fmtAxis(v) {
  if (v >= 1e6) return +(v / 1e6).toFixed(2) + "M";
  if (v >= 1e3) return +(v / 1e3).toFixed(2) + "k";
  return String(+v.toFixed(2));
}

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---- clients -------------------------------------------------------------

function renderClients(data) {
  const body = $("clients").tBodies[0];
  if (data.clients.length === 0) {
    body.replaceChildren(el("tr", { class: "empty-row" }, el("td", { colSpan: 4 }, "No client in the last 5 minutes")));
    return;
  }
  body.replaceChildren(...data.clients.map((c) =>
    el("tr", {},
      el("td", { class: "mono" }, c.address),
      el("td", {}, "server " + c.server),
      el("td", { class: "num" }, fmtInt(c.connections)),
      el("td", { class: "num" }, c.last_seen_seconds_ago === 0 ? "now" : fmtDuration(c.last_seen_seconds_ago) + " ago"))));
}

// ---- control -------------------------------------------------------------

function say(text, isError) {
  const m = $("message");
  m.textContent = text;
  m.classList.toggle("error", !!isError);
}

async function control(line, button) {
  button.disabled = true;
  try {
    const r = await fetch("/control", {
      method: "POST",
      headers: { "Content-Type": "text/plain; charset=utf-8", "X-Quill-Control": "1" },
      body: line,
    });
    const text = (await r.text()).trim();
    if (r.ok) say("Done: " + line, false);
    else say(text || "HTTP " + r.status, true);
  } catch (e) {
    say("Request failed: " + e.message, true);
  }
  await refresh();
}

// ---- polling -------------------------------------------------------------

async function refresh() {
  try {
    const [status, history] = await Promise.all([getJson("/status.json"), getJson("/history.json")]);
    renderSummary(status);
    renderServers(status);
    renderChart(history);
    setLive(true);
  } catch (e) {
    setLive(false);
  }
}

async function refreshClients() {
  try {
    renderClients(await getJson("/clients.json"));
  } catch (e) {
    setLive(false);
  }
}

async function start() {
  try {
    canControl = (await getJson("/control")).permitted === true;
  } catch (e) {
    canControl = false;
  }
  $("control-note").textContent = canControl
    ? "Blacklist: no new connections to a server for an hour. Drain: none until undrained; open ones finish."
    : "Read-only: control_acl does not permit your address.";
  await Promise.all([refresh(), refreshClients()]);
  setInterval(refresh, 1000);
  setInterval(refreshClients, 5000);
}

start();
