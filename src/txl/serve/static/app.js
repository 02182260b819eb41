// txl playground: talks to the JSON API of `txl serve` (docs/guide/evaluation.md, "The playground: txl serve"). No dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  model: null,            // GET /api/model
  streams: [],            // per run: {ids, first, pieces, logprobs, session, el, info, abort}
  selected: null,         // {run, token}
};
const COLORS = ["#2f5fd0", "#d0582f"];
const ARCHS = { decoder: "Transformer-XL (decoder)", lstm: "recurrent: LSTM (lstm)", "sha-rnn": "recurrent: SHA-RNN (sha-rnn)" };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "muted";
}

async function api(path, body) {
  const response = await fetch(path, body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
  return data;
}

// ---------------------------------------------------------------------------------------------
// colours

// log-probability -> background: likely tokens pale green, unlikely ones red
function probColor(logprob) {
  const p = Math.exp(logprob);
  const hue = 120 * Math.min(1, Math.max(0, (logprob + 6) / 6));  // 0 (p <= e^-6) … 120 (p = 1)
  return `hsla(${hue}, 70%, 55%, ${0.25 + 0.45 * (1 - p)})`;
}

function heat(value) {  // 0…1 -> white … dark blue
  const v = Math.max(0, Math.min(1, value));
  const r = Math.round(255 - 215 * v), g = Math.round(255 - 175 * v), b = Math.round(255 - 55 * v);
  return `rgb(${r},${g},${b})`;
}

// ---------------------------------------------------------------------------------------------
// start-up: model cards and controls

async function init() {
  try {
    state.model = await api("/api/model");
  } catch (err) {
    setStatus(`cannot reach the server: ${err.message}`, true);
    return;
  }
  const runs = state.model.runs;
  $("runs-label").textContent = runs.map((r) => `${r.name} (${r.vocab.kind}, ${formatCount(r.parameters)} parameters)`).join("  vs  ");
  $("max-new-tokens").max = state.model.limits.max_new_tokens;
  $("mem-a").value = runs[0].config.mem_len;
  runs.forEach((run, i) => {
    $("score-run").append(el("option", { value: i, text: run.name }));
    state.streams.push(makeStream(run, i));
    $("cards").append(modelCard(run, i));
  });
  // the attention panel only where some run has attention to show (not for an LSTM alone)
  const viewable = runs.find((run) => !run.no_attention_view);
  $("attention").hidden = !viewable;
  if (viewable) {
    fillSelect($("layer"), viewable.config.n_layer, "layer");
    fillSelect($("head"), viewable.config.n_head, "head");
  }
  $("generate").addEventListener("click", () => generateAll(false));
  $("continue").addEventListener("click", () => generateAll(true));
  $("stop").addEventListener("click", () => state.streams.forEach((s) => s.abort && s.abort.abort()));
  $("layer").addEventListener("change", showAttention);
  $("head").addEventListener("change", showAttention);
  $("rescore").addEventListener("click", rescore);
  $("score-run").addEventListener("change", () => { $("mem-a").value = runs[$("score-run").value].config.mem_len; });
  document.body.dataset.ready = "1";
}

function fillSelect(select, count, what) {
  const keep = select.value;
  select.replaceChildren(...Array.from({ length: count }, (_, i) => el("option", { value: i, text: `${what} ${i}` })));
  if (keep && Number(keep) < count) select.value = keep;
}

function formatCount(n) {
  return n >= 1e6 ? `${(n / 1e6).toFixed(1)}M` : n >= 1e3 ? `${(n / 1e3).toFixed(1)}k` : String(n);
}

function makeStream(run, index) {
  const text = el("div", { class: "text", id: `text-${index}` });
  const info = el("div", { class: "muted", id: `info-${index}`, text: "no text yet" });
  const notice = el("div", { class: "notice", id: `notice-${index}` });  // prompt words read as <unk>
  notice.hidden = true;
  const legend = el("div", { class: "legend" }, "token colour = log-probability:");
  for (const lp of [-0.05, -1, -3, -6]) {
    const sw = el("span", { class: "swatch" });
    sw.style.background = probColor(lp);
    legend.append(sw, `${Math.exp(lp).toFixed(lp > -1 ? 2 : 3)}`);
  }
  if (run.no_attention_view) text.classList.add("no-attention");
  const panel = el("div", { class: "panel output" }, el("h2", { text: run.name }), text, notice, info, legend);
  $("outputs").append(panel);
  return { run: index, ids: [], pieces: [], logprobs: [], session: null, el: text, info, notice, abort: null };
}

function modelCard(run, index) {
  const c = run.config;
  const transformer = c.n_head !== undefined;  // the recurrent runs have no heads, positions or attention kernel
  const rows = [
    ["architecture", ARCHS[c.arch] || c.arch],
    ["parameters", run.parameters.toLocaleString()], ["corpus", run.corpus || "unknown"],
    ["vocabulary", `${run.vocab.kind}, ${run.vocab.size} ids`], ["trained steps", run.step ?? "?"],
    ["layers × d_model", `${c.n_layer} × ${c.d_model}`],
    ...(transformer ? [["heads × d_head", `${c.n_head} × ${c.d_head}`]] : []),
    ["d_inner", c.d_inner], [transformer ? "mem_len" : "mem_len (carried state)", c.mem_len],
    ...(transformer ? [["pos_encoding", c.pos_encoding], ["attention", c.attention]] : []),
    ["segment (tgt_len)", run.train.tgt_len ?? "?"], ["eval segment", run.eval_tgt_len],
  ];
  const table = el("table", { class: "config" }, ...rows.map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { text: String(v) }))));
  const canvas = el("canvas", { width: 380, height: 200, id: `curve-${index}` });
  drawLines(canvas, Object.entries(run.curve).map(([split, points], i) => ({
    label: split, color: ["#2f5fd0", "#d0582f", "#2a9d58"][i % 3], points,
  })), { xlabel: "step", ylabel: "loss (nats)" });
  return el("div", { class: "panel" }, el("h2", { text: `model card: ${run.name}` }),
    el("div", { class: "card-body" }, table, canvas));
}

// ---------------------------------------------------------------------------------------------
// generation (server-sent events over fetch)

function settings() {
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  return {
    max_new_tokens: num("max-new-tokens"), temperature: num("temperature"), top_k: num("top-k"),
    top_p: num("top-p"), seed: num("seed"), mem_len: num("mem-len"),
  };
}

async function generateAll(cont) {
  $("generate").disabled = $("continue").disabled = true;
  $("stop").disabled = false;
  setStatus("generating…");
  // Continue goes on from the end of the text on the page (the session's memory): it feeds nothing
  // new. The prompt box belongs to Generate (issue 45: Continue fed it into the text a second time).
  const prompt = cont ? "" : $("prompt").value;
  const results = await Promise.allSettled(state.streams.map((s) => generateOne(s, prompt, cont)));
  $("generate").disabled = false;
  $("continue").disabled = !state.streams.every((s) => s.session);
  $("stop").disabled = true;
  const failed = results.find((r) => r.status === "rejected");
  setStatus(failed ? failed.reason.message : "done", Boolean(failed));
}

async function generateOne(stream, prompt, cont) {
  const body = { run: stream.run, prompt, ...settings() };
  if (cont) {
    if (!stream.session) throw new Error("generate first; Continue goes on from that memory");
    Object.assign(body, { session: stream.session, continue: true });
    delete body.mem_len;
    delete body.seed;  // the session's random stream draws on: Generate 20 + Continue 15 = Generate 35
  } else {
    stream.ids = []; stream.pieces = []; stream.logprobs = []; stream.el.replaceChildren();
    stream.session = null;  // a new text: Continue waits for its session (not the cleared text's)
  }
  stream.abort = new AbortController();
  const response = await fetch("/api/generate", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: stream.abort.signal,
  }).catch((err) => { throw new Error(err.name === "AbortError" ? "stopped" : err.message); });
  if (!response.ok) {
    if (cont && response.status === 404) {  // the server dropped this session's memory (idle or full)
      stream.session = null;
      throw new Error("the server no longer holds this text's memory; press Generate to start again");
    }
    throw new Error((await response.json()).error);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let event = "message", data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith("event: ")) event = line.slice(7);
          else if (line.startsWith("data: ")) data += line.slice(6);
        }
        if (data) onEvent(stream, event, JSON.parse(data));
      }
    }
  } catch (err) {
    if (err.name !== "AbortError") throw err;
  }
}

function onEvent(stream, event, data) {
  if (event === "start") {
    stream.session = data.session;
    if (data.reseeded) {  // a new generation: its prompt's notice, or none; a continuation keeps the last
      stream.notice.textContent = data.notice || "";
      stream.notice.hidden = !data.notice;
    }
    stream.info.textContent = `seed ${data.seed}${data.reseeded ? "" : " (continued)"}, mem_len ${data.mem_len}; session ${data.session}`;
    data.prompt_ids.forEach((id, k) => addToken(stream, id, data.prompt_pieces[k], null));
  } else if (event === "token") {
    addToken(stream, data.id, data.text, data.logprob);
  } else if (event === "done") {
    const generated = stream.logprobs.filter((x) => x !== null);
    const nll = generated.length ? -generated.reduce((a, b) => a + b, 0) / generated.length : 0;
    stream.info.textContent += ` · ${data.tokens} tokens (${data.stopped_by}), ` +
      `${data.ms_per_token ? data.ms_per_token.toFixed(1) : "–"} ms/token, mean NLL ${nll.toFixed(3)} nats`;
    stream.el.dataset.done = String(stream.ids.length);
  } else if (event === "error") {
    throw new Error(data.error);
  }
}

function addToken(stream, id, text, logprob) {
  const pos = stream.ids.length;
  stream.ids.push(id); stream.pieces.push(text); stream.logprobs.push(logprob);
  const span = el("span", { class: logprob === null ? "tok prompt" : "tok gen", "data-pos": pos, text: text || "\u200b" });
  if (logprob !== null) {
    span.style.background = probColor(logprob);
    span.title = `token ${pos}: id ${id}, log p = ${logprob.toFixed(3)}`;
  }
  if (pos > 0 && !$("attention").hidden) span.addEventListener("click", () => selectToken(stream.run, pos));
  stream.el.append(span);
  stream.el.scrollTop = stream.el.scrollHeight;
}

// ---------------------------------------------------------------------------------------------
// attention view

function selectToken(run, token) {
  state.selected = { run, token };
  document.querySelectorAll(".tok.selected").forEach((n) => n.classList.remove("selected"));
  const span = document.querySelector(`#text-${run} .tok[data-pos="${token}"]`);
  if (span) span.classList.add("selected");
  const card = state.model.runs[run];
  if (card.no_attention_view) {  // a recurrent run beside a Transformer: say why, in one sentence
    $("attn-info").textContent = card.no_attention_view;
    $("attn-info").className = "muted";
    $("attn-strip").replaceChildren();
    for (const id of ["attn-matrix", "attn-distance"]) $(id).getContext("2d").clearRect(0, 0, $(id).width, $(id).height);
    $("attention").dataset.state = "unavailable";
    return;
  }
  const config = card.config;
  fillSelect($("layer"), config.n_layer, "layer");
  fillSelect($("head"), config.n_head, "head");
  showAttention();
}

async function showAttention() {
  if (!state.selected) return;
  const { run, token } = state.selected;
  const stream = state.streams[run];
  const layer = Number($("layer").value), head = Number($("head").value);
  $("attention").dataset.state = "loading";
  try {
    const result = await api("/api/score", { run, ids: stream.ids, attention: { token, layer, head } });
    renderAttention(stream, result);
    $("attention").dataset.state = "ready";
  } catch (err) {
    $("attn-info").textContent = err.message;
    $("attn-info").className = "error";
    $("attention").dataset.state = "error";
  }
}

function renderAttention(stream, result) {
  const a = result.attention;
  const row = a.rows[a.layer][a.head];
  const memory = a.segment_start - Math.max(a.first_key, 0);
  $("attn-info").className = "muted";
  $("attn-info").textContent = `query at position ${a.query} predicting token ${a.token} ` +
    `(“${result.tokens[a.token]}”, NLL ${result.nll[a.token - 1].toFixed(3)}); scored in segments of ${result.tgt_len} ` +
    `with mem_len ${result.mem_len}: ${memory} memory keys, then the segment ${a.segment_start}…${a.segment_end - 1}`;
  // Long views come downsampled (issue 50): a cell sums keys_per_cell keys, a matrix row averages
  // queries_per_row queries; with 1 each, a cell is one key.
  const per = a.keys_per_cell || 1;
  if (per > 1) $("attn-info").textContent += ` (shown in cells of ${per} keys; the matrix rows average ${a.queries_per_row} queries)`;
  const strip = $("attn-strip");
  strip.replaceChildren();
  const top = Math.max(...row);
  row.forEach((w, j) => {
    const pos = a.first_key + j * per, last = Math.min(pos + per, a.segment_end) - 1;
    if (pos <= a.segment_start && a.segment_start < pos + per && j > 0) strip.append(el("span", { class: "boundary", title: "memory | segment" }));
    else if (pos > 0 && Math.floor(last / result.tgt_len) > Math.floor((pos - 1) / result.tgt_len) && j > 0) strip.append(el("span", { class: "earlier", title: "an earlier segment starts here" }));
    const mine = pos <= a.query && a.query <= last;
    const text = per === 1 ? (pos >= 0 ? (result.tokens[pos] || "\u200b") : "·") : result.tokens.slice(Math.max(pos, 0), last + 1).join("") || "·";
    const span = el("span", { class: "key" + (last < a.segment_start ? " mem" : "") + (mine ? " query" : ""), text });
    span.style.background = heat(w / top);
    span.title = per === 1 ? `position ${pos}: ${(100 * w).toFixed(2)}%` : `positions ${pos}…${last}: ${(100 * w).toFixed(2)}%`;
    strip.append(span);
  });
  drawMatrix($("attn-matrix"), a, memory, result.tgt_len);
  drawBars($("attn-distance"), a.avg_distance[a.layer], a.head);
}

function drawMatrix(canvas, a, memory, tgtLen) {
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, pad = 28;
  ctx.clearRect(0, 0, W, H);
  const rows = a.matrix.length, cols = a.matrix[0].length;
  const cw = (W - pad - 4) / cols, ch = (H - pad - 4) / rows;
  for (let i = 0; i < rows; i++) {
    const top = Math.max(...a.matrix[i]) || 1;
    for (let j = 0; j < cols; j++) {
      ctx.fillStyle = heat(a.matrix[i][j] / top);
      ctx.fillRect(pad + j * cw, pad + i * ch, Math.ceil(cw), Math.ceil(ch));
    }
  }
  const per = a.keys_per_cell || 1, perRow = a.queries_per_row || 1;  // keys per cell, queries per row
  ctx.strokeStyle = "#8a8f9c"; ctx.lineWidth = 1; ctx.setLineDash([3, 3]);  // earlier segments inside the memory
  for (let k = 1; k < memory; k++) {
    if ((a.first_key + k) % tgtLen === 0) { const x = pad + (k / per) * cw; ctx.beginPath(); ctx.moveTo(x, pad); ctx.lineTo(x, H - 2); ctx.stroke(); }
  }
  ctx.setLineDash([]);
  const boundary = pad + (memory / per) * cw;  // memory | segment
  ctx.strokeStyle = "#c0392b"; ctx.lineWidth = 2;
  ctx.beginPath(); ctx.moveTo(boundary, pad - 6); ctx.lineTo(boundary, H - 2); ctx.stroke();
  const q = Math.floor((a.query - a.segment_start) / perRow);
  ctx.strokeStyle = "#2f5fd0"; ctx.strokeRect(pad, pad + q * ch, W - pad - 4, Math.max(ch, 2));
  ctx.fillStyle = "#1d2330"; ctx.font = "11px sans-serif";
  ctx.fillText("memory", pad, pad - 10);
  ctx.fillText("segment", boundary + 4, pad - 10);
  ctx.save(); ctx.translate(12, H / 2 + 20); ctx.rotate(-Math.PI / 2); ctx.fillText("queries", 0, 0); ctx.restore();
}

function drawBars(canvas, values, selected) {
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, pad = 34;
  ctx.clearRect(0, 0, W, H);
  const top = Math.max(1, ...values);
  const bw = (W - pad - 10) / values.length;
  ctx.font = "11px sans-serif";
  values.forEach((v, h) => {
    const height = (H - 2 * pad) * v / top;
    ctx.fillStyle = h === selected ? "#2f5fd0" : "#9fb3e6";
    ctx.fillRect(pad + h * bw + 3, H - pad - height, bw - 6, height);
    ctx.fillStyle = "#1d2330";
    ctx.fillText(v.toFixed(1), pad + h * bw + 3, H - pad - height - 4);
    ctx.fillText(`h${h}`, pad + h * bw + bw / 2 - 6, H - pad + 14);
  });
  ctx.fillText("tokens back", 2, 14);
}

// ---------------------------------------------------------------------------------------------
// loss against position for two memory lengths

async function rescore() {
  const run = Number($("score-run").value);
  const stream = state.streams[run];
  const text = stream.ids.length >= 2 ? null : $("prompt").value;
  if (!text && stream.ids.length < 2) { $("score-info").textContent = "generate or type some text first"; return; }
  const lens = [Number($("mem-a").value), Number($("mem-b").value)];
  $("score-info").textContent = "scoring…";
  try {
    const results = await Promise.all(lens.map((mem_len) => api("/api/score", text === null ? { run, ids: stream.ids, mem_len } : { run, text, mem_len })));
    const [a, b] = results, n = a.nll.length;
    // Memory carries earlier segments into the next; a text of one segment has none, so both curves are
    // the same curve (issue 45: drawn twice with no word why). One curve then, and the sentence.
    const oneSegment = n <= a.tgt_len;
    const same = oneSegment || a.nll.every((v, k) => Math.abs(v - b.nll[k]) <= 1e-6);
    const shown = same ? [a] : results;
    drawLines($("loss-plot"), shown.map((r, i) => ({
      label: same ? `mem_len ${a.mem_len} and ${b.mem_len}: mean ${r.mean_nll.toFixed(3)} nats` : `mem_len ${r.mem_len}: mean ${r.mean_nll.toFixed(3)} nats`,
      color: COLORS[i], points: r.nll.map((v, k) => [k + 1, v]),
    })), { xlabel: "token position", ylabel: "NLL (nats)" });
    $("loss-plot").dataset.curves = String(shown.length);
    let why = `${n} predictions, segments of ${a.tgt_len}`;
    if (oneSegment) {
      why = `${n} predictions fit in one segment of ${a.tgt_len}, so memory cannot change them: both memory ` +
        `lengths give this one curve. Score a text longer than ${a.tgt_len} tokens to see what memory does.`;
    } else if (same) {
      why += `; both memory lengths give the same losses` +
        (state.model.runs[run].config.arch === "lstm" ? " (an LSTM carries its whole state for any mem_len above 0)" : "");
    }
    $("score-info").textContent = why;
    $("memory").dataset.state = "ready";
  } catch (err) {
    $("score-info").textContent = err.message;
  }
}

function drawLines(canvas, series, { xlabel, ylabel }) {
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, left = 44, right = 10, top = 10, bottom = 30;
  ctx.clearRect(0, 0, W, H);
  const all = series.flatMap((s) => s.points);
  ctx.font = "11px sans-serif"; ctx.fillStyle = "#6b7385";
  if (!all.length) { ctx.fillText("no data (no metrics.jsonl next to this checkpoint)", left, H / 2); return; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs) || 1, y0 = Math.min(0, ...ys), y1 = Math.max(...ys) || 1;
  const X = (x) => left + (W - left - right) * (x - x0) / ((x1 - x0) || 1);
  const Y = (y) => H - bottom - (H - top - bottom) * (y - y0) / ((y1 - y0) || 1);
  ctx.strokeStyle = "#d9dde6"; ctx.beginPath(); ctx.moveTo(left, top); ctx.lineTo(left, H - bottom); ctx.lineTo(W - right, H - bottom); ctx.stroke();
  ctx.fillText(y1.toFixed(2), 2, top + 8); ctx.fillText(y0.toFixed(2), 2, H - bottom);
  ctx.fillText(String(x0), left, H - bottom + 14); ctx.fillText(String(x1), W - right - 30, H - bottom + 14);
  ctx.fillText(xlabel, W / 2 - 20, H - 4);
  ctx.save(); ctx.translate(12, (H - bottom) / 2 + 30); ctx.rotate(-Math.PI / 2); ctx.fillText(ylabel, 0, 0); ctx.restore();
  [...series].reverse().forEach((s) => {  // the first series on top
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.5; ctx.beginPath();
    s.points.forEach(([x, y], k) => (k ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
    ctx.stroke();
  });
  const width = Math.max(...series.map((s) => ctx.measureText(s.label).width)) + 26;
  ctx.fillStyle = "rgba(255,255,255,0.85)"; ctx.fillRect(W - right - width - 4, top, width + 4, 8 + 14 * series.length);
  series.forEach((s, i) => {
    ctx.fillStyle = s.color; ctx.fillRect(W - right - width, top + 6 + 14 * i, 12, 3);
    ctx.fillText(s.label, W - right - width + 16, top + 11 + 14 * i);
  });
}

init();
