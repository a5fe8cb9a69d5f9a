// moefit's page: a live monitor of the ledger and the expert cache, and a chat tab.
// Plain JavaScript, no build step, nothing fetched from outside this server.
"use strict";

const $ = (id) => document.getElementById(id);
const MIB = 1048576;
const COLORS = { "other processes": "--other", "dense weights": "--dense", "sequence state": "--kv",
  "prompt path": "--reserve", "verify arena": "--reserve", "draft head": "--reserve", "headroom": "--reserve",
  "expert cache": "--cache", "free after start": "--free" };
const samples = [];            // {t, hitRate, slots}
let chatMessages = [];

// ---- the API key: asked once, kept in session storage, never in the page --------------
function apiKey() { return sessionStorage.getItem("moefit-key") || ""; }

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (apiKey()) headers.Authorization = "Bearer " + apiKey();
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) { $("keyform").hidden = false; throw new Error("API key required"); }
  return response;
}

$("keyform").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("moefit-key", $("apikey").value);
  $("keyform").hidden = true;
  refresh();
});

// ---- tabs ---------------------------------------------------------------------------------
function selectTab(name) {
  for (const tab of ["monitor", "chat"]) {
    const on = tab === name;
    $("tab-" + tab).setAttribute("aria-selected", on);
    $("tab-" + tab).tabIndex = on ? 0 : -1;
    $(tab).hidden = !on;
  }
  if (name === "chat") $("prompt").focus();
}
for (const tab of ["monitor", "chat"]) $("tab-" + tab).addEventListener("click", () => selectTab(tab));
document.querySelector("nav").addEventListener("keydown", (e) => {
  if (e.key === "ArrowRight" || e.key === "ArrowLeft") {
    const next = $("tab-monitor").getAttribute("aria-selected") === "true" ? "chat" : "monitor";
    selectTab(next);
    $("tab-" + next).focus();
  }
});

// ---- monitor ------------------------------------------------------------------------------
const mib = (b) => (b / MIB).toLocaleString(undefined, { maximumFractionDigits: b < 10 * MIB ? 2 : 0 }) + " MiB";

function ledgerSegments(status) {
  const out = [];
  for (const line of status.ledger) {
    if (line.name === "reserve") line.parts.forEach((p) => out.push({ name: "reserve: " + p.name, key: p.name, bytes: p.bytes }));
    else out.push({ name: line.name, key: line.name, bytes: Math.max(0, line.bytes) });
  }
  return out;
}

function drawLedger(status) {
  const total = status.device.total_bytes;
  $("ledger-title").textContent = `${status.device.name}: ${mib(total)}`;
  const bar = $("ledger-bar"), legend = $("ledger-legend");
  bar.replaceChildren(); legend.replaceChildren();
  for (const seg of ledgerSegments(status)) {
    const div = document.createElement("div");
    div.style.width = (100 * seg.bytes / total) + "%";
    div.style.background = `var(${COLORS[seg.key] || "--other"})`;
    if (seg.key === "headroom") div.style.opacity = 0.55;
    div.title = `${seg.name}: ${mib(seg.bytes)}`;
    div.dataset.name = seg.name;
    div.dataset.bytes = seg.bytes;
    bar.appendChild(div);
    const li = document.createElement("li");
    li.innerHTML = `<i style="background: var(${COLORS[seg.key] || "--other"})"></i>`;
    li.append(`${seg.name} ${mib(seg.bytes)}`);
    legend.appendChild(li);
  }
}

function drawChecks(status) {
  const sc = status.serve_check;
  $("serve-check").innerHTML = `<span class="${sc.status === "OK" ? "ok" : "low"}">${sc.status}</span> `;
  $("serve-check").append(sc.message);
  const sp = status.speculative;           // the reason already starts with the mode ("lookup: window 4 ...")
  $("speculative").textContent = `${sp.enabled ? "on" : "off"}: ${sp.reason}` +
    (sp.windows ? `; ${sp.accepted}/${sp.drafted} drafts accepted in ${sp.windows} windows` : "");
  const zero = status.start && status.start.zero_check;
  $("zero-check").innerHTML = zero ? `<span class="${zero.verdict === "DIRTY" ? "dirty" : "ok"}">${zero.verdict}</span> ` : "";
  $("zero-check").append(zero ? zero.message.replace(zero.verdict + ": ", "") : "cpu device: no card to check");
  $("culprits").replaceChildren(...(zero ? zero.culprits : []).map((c) => {
    const li = document.createElement("li");
    li.textContent = `${c.pid} ${c.name}: ${mib(c.bytes_over)} over (${c.why})`;
    return li;
  }));
  $("verdict").textContent = (status.start && status.start.verdict) || "-";
  $("sessions").textContent = status.sessions.map((s, i) =>     // --sessions: conversations whose state is kept
    `${i + 1}: ${s.tokens} tokens${s.current ? " (the last request's)" : ""}`).join("; ");
}

function lookAhead(c) {
  if (!c.prefetch_per_layer) return "look-ahead off";
  const recall = c.prediction_recall == null ? "-" : (100 * c.prediction_recall).toFixed(0) + " %";
  const late = c.prefetch_late ? `, ${c.prefetch_late} late (computed on the host)` : "";
  return `look-ahead (${c.predictor}): next-layer recall ${recall}, ${c.prefetched} prefetched ` +
    `(${c.prefetch_hits} used in time)${late}`;
}

function drawCache(status) {
  const c = status.expert_cache;
  $("cache-summary").textContent = `${c.slots} of ${c.total_experts} experts resident (${mib(c.used_bytes)} of a ` +
    `${mib(c.budget_bytes)} budget; planned ${c.planned_slots}), hit rate ${(100 * c.hit_rate).toFixed(1)} % ` +
    `(${c.hits} hits, ${c.misses} misses, ${c.swaps} swaps); ${lookAhead(c)}; ` +
    `guard warnings ${status.guard.warnings}, resizes ${status.guard.resizes}`;
  if (!samples.length) (status.cache_samples || []).forEach((s) => samples.push({ t: s.time, hitRate: s.hit_rate, slots: s.slots }));
  samples.push({ t: Date.now() / 1000, hitRate: c.hit_rate, slots: c.slots });
  while (samples.length && samples[0].t < Date.now() / 1000 - 600) samples.shift();
  drawChart(status.guard.events, c.total_experts);
  const bars = $("layer-bars");
  bars.replaceChildren(...c.layer_hit_rates.map((r, i) => {
    const div = document.createElement("div");
    div.style.height = Math.max(1, 100 * r) + "%";
    div.title = `layer ${i}: ${(100 * r).toFixed(1)} % hits`;
    div.dataset.layer = i;
    const label = document.createElement("span");
    label.textContent = `L${i} ${(100 * r).toFixed(0)}%`;
    div.appendChild(label);
    return div;
  }));
}

function drawChart(events, totalExperts) {
  const canvas = $("hit-chart"), g = canvas.getContext("2d");
  const css = getComputedStyle(document.documentElement);
  const w = canvas.width, h = canvas.height, pad = 24;
  g.clearRect(0, 0, w, h);
  if (!samples.length) return;
  const t1 = samples[samples.length - 1].t, t0 = Math.min(samples[0].t, t1 - 60);
  const x = (t) => pad + (w - 2 * pad) * (t - t0) / Math.max(1, t1 - t0);
  const line = (key, scale, color) => {
    g.strokeStyle = color; g.lineWidth = 2; g.beginPath();
    samples.forEach((s, i) => { const y = h - pad - (h - 2 * pad) * s[key] / scale; i ? g.lineTo(x(s.t), y) : g.moveTo(x(s.t), y); });
    g.stroke();
  };
  line("hitRate", 1, css.getPropertyValue("--cache"));
  line("slots", Math.max(1, totalExperts), css.getPropertyValue("--accent"));
  drawAxes(g, css, w, h, pad, t1 - t0, totalExperts);
  canvas.dataset.points = samples.length;
  let marks = 0;
  for (const e of events.filter((e) => e.time >= t0)) {
    g.fillStyle = css.getPropertyValue(e.kind === "warning" || e.kind === "oom" ? "--warn" : "--reserve");
    const px = x(e.time);
    g.beginPath();
    if (e.kind === "warning" || e.kind === "oom") { g.moveTo(px, pad - 10); g.lineTo(px - 6, pad); g.lineTo(px + 6, pad); }
    else g.arc(px, h - pad + 10, 5, 0, 2 * Math.PI);
    g.fill();
    marks++;
  }
  canvas.dataset.marks = marks;
  canvas.dataset.warnings = events.filter((e) => e.kind === "warning").length;
}

function drawAxes(g, css, w, h, pad, span, totalExperts) {
  g.fillStyle = css.getPropertyValue("--muted") || "#888";
  g.font = "11px sans-serif";
  g.textAlign = "left";
  g.fillText("hit rate 100 %", 2, pad - 12 > 8 ? pad - 12 : 10);
  g.fillText("0 %", 2, h - pad + 4);
  g.textAlign = "right";
  g.fillText(`${totalExperts} slots`, w - 2, pad - 12 > 8 ? pad - 12 : 10);
  g.fillText("0", w - 2, h - pad + 4);
  g.textAlign = "center";
  g.fillText(`time: the last ${Math.round(span)} s`, w / 2, h - 4);
  $("hit-chart").dataset.axes = "hit rate,slots,time";
}

function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }

function drawRecent(status) {
  $("recent").tBodies[0].replaceChildren(...status.recent_requests.slice(-10).reverse().map((r) => {
    const tr = document.createElement("tr");
    tr.append(cell(new Date(r.time * 1000).toLocaleTimeString()), cell(r.prompt_tokens), cell(r.generated),
      cell(r.ttft_s.toFixed(3) + " s"), cell(r.decode_tokens_per_s.toFixed(1)), cell(r.status));
    return tr;
  }));
}

async function drawHistory() {
  const rows = (await (await api("/v1/history")).json()).starts;
  $("history").tBodies[0].replaceChildren(...rows.slice(-12).map((r) => {
    const tr = document.createElement("tr");
    tr.append(cell(r.id), cell(new Date(r.time * 1000).toLocaleString()),
      cell(`${r.zero_check || "?"}: ${mib(r.free_bytes_at_start || 0)} free`),
      cell(r.slots == null ? "-" : `${r.slots} / ${mib(r.cache_bytes || 0)}`),
      cell(r.outcome), cell(r.hit_rate == null ? "-" : (100 * r.hit_rate).toFixed(0) + " %"),
      cell(r.decode_tokens_per_s ? r.decode_tokens_per_s.toFixed(1) : "-"), cell(r.verdict || r.message || ""));
    return tr;
  }));
}

let ticks = 0;
async function refresh() {
  try {
    const response = await api("/v1/status");
    const status = await response.json();
    if (status.status === "loading" || status.status === "failed") { $("model").textContent = status.status; return; }
    $("model").textContent = `${status.model} · up ${Math.round(status.uptime_s)} s`;
    if (status.ledger.length) drawLedger(status);
    drawChecks(status);
    drawCache(status);
    drawRecent(status);
    if (ticks++ % 5 === 0) await drawHistory();
    document.body.dataset.refreshed = ticks;
  } catch (err) { /* shown by the key form, or retried on the next tick */ }
}

// ---- chat ---------------------------------------------------------------------------------
function bubble(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  $("messages").appendChild(div);
  return div;
}

async function send(e) {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  chatMessages.push({ role: "user", content: text });
  bubble("user").textContent = text;
  const out = bubble("assistant");
  const thinking = document.createElement("details"), body = document.createElement("div");
  thinking.innerHTML = "<summary>reasoning</summary>";
  thinking.hidden = true;
  out.append(thinking, body);
  const controller = new AbortController();
  $("stop").disabled = false; $("send").disabled = true;
  $("stop").onclick = () => controller.abort();
  let answer = "";
  try {
    const response = await api("/v1/chat/completions", { method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ messages: chatMessages, stream: true, max_tokens: Number($("maxtokens").value) }) });
    if (!response.ok) throw new Error((await response.json()).error.message);
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const delta = (JSON.parse(event.slice(6)).choices[0] || {}).delta || {};
        if (delta.reasoning_content) { thinking.hidden = false; thinking.append(delta.reasoning_content); }
        if (delta.content) { answer += delta.content; body.textContent = answer; }
      }
    }
    out.dataset.done = "complete";
  } catch (err) {
    out.dataset.done = controller.signal.aborted ? "stopped" : "error";
    if (!controller.signal.aborted) body.textContent = answer + "\n[" + err.message + "]";
  }
  chatMessages.push({ role: "assistant", content: answer });
  $("stop").disabled = true; $("send").disabled = false;
}
$("chatform").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chatform").requestSubmit(); }
});

refresh();
setInterval(refresh, 1500);
