// captum_transformers explorer: the generation page. Type or pick a prompt, generate greedily, click a
// generated token to colour its evidence in the prompt and the earlier output. The click recolours
// from the matrices already loaded (no request). Every string from the server or the user (tokens,
// prompts, method names, errors) is written with textContent, never as HTML. The session token comes
// once from the URL (?token=...), is kept in sessionStorage and sent as a header; URLs are relative.
"use strict";

const state = {
  token: null, session: null, arguments: {}, result: null, request: null, step: null, job: null, seq: 0,
  recolours: 0,
};

function readToken() {
  const fromUrl = new URLSearchParams(window.location.search).get("token");
  if (fromUrl) {
    sessionStorage.setItem("captum-explorer-token", fromUrl);
    window.history.replaceState(null, "", window.location.pathname);  // keep it out of screenshots
  }
  return sessionStorage.getItem("captum-explorer-token");
}

async function api(path, body) {
  const options = { headers: { "X-Explorer-Token": state.token || "" } };
  if (body !== undefined) {
    options.method = "POST";
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  const payload = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) {
    const error = new Error(payload.error || `HTTP ${response.status}`);
    error.payload = payload;
    error.status = response.status;
    throw error;
  }
  return payload;
}

async function loadSession() {  // while the model loads the server answers {"state": "loading", "seconds"}
  for (;;) {
    const payload = await api("api/session");
    if (payload.state !== "loading") return payload;
    setStatus(`loading the model… ${Number(payload.seconds).toFixed(1)} s`, null, null);
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
}

// -- colours: the explorer's (explorer.js diverging, export.py diverging) ----------------------
// t in [-1, 1] -> [r, g, b]: blue (against), white (0), red (for); an unsigned map is >= 0, so
// white -> red. Each row is scaled by its largest absolute value.
function diverging(t) {
  const p = Math.max(t, 0), n = Math.max(-t, 0);
  return [255 * (1 - 0.8 * n), 255 * (1 - 0.8 * (p + n)), 255 * (1 - 0.8 * p)];
}
function rgb(t) { return `rgb(${diverging(t).map(Math.round).join(",")})`; }

function drawLegend(signed) {
  const legend = document.getElementById("legend");
  const stops = signed ? [-1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1] : [0, 0.25, 0.5, 0.75, 1];
  const bar = el("span", { class: "bar" });
  for (const stop of stops) {
    const swatch = el("span");
    swatch.style.backgroundColor = rgb(stop);
    bar.append(swatch);
  }
  legend.dataset.signed = signed ? "yes" : "no";
  legend.replaceChildren(el("span", { text: signed ? "against" : "0" }), bar,
    el("span", { text: signed ? "for" : "more relevant" }),
    el("span", { text: signed ? "(signed: red = evidence for the token, blue = against; scaled per token)"
      : "(unsigned: darker red = more relevant, no direction; scaled per token)" }));
}

// -- method, arguments and score controls -----------------------------------------------------
function methodEntry(name) { return state.session.methods.find((m) => m.name === name); }

function fieldInput(method, field) {
  let input;
  if (field.kind === "choice") {
    input = el("select", { "data-field": field.name });
    for (const choice of field.choices) input.append(el("option", { value: choice, text: choice }));
  } else if (field.kind === "boolean") {
    input = el("input", { type: "checkbox", "data-field": field.name });
  } else {
    input = el("input", { type: "number", "data-field": field.name, step: field.kind === "integer" ? "1" : "0.05" });
  }
  const value = state.arguments[method][field.name];
  if (field.kind === "boolean") input.checked = !!value;
  else input.value = value === null || value === undefined ? "" : value;
  input.addEventListener("change", () => {
    let next = input.value;
    if (field.kind === "boolean") next = input.checked;
    else if (field.kind !== "choice") next = next === "" ? (field.optional ? null : field.default) : Number(next);
    state.arguments[method][field.name] = next;
    regenerate();
  });
  return el("label", {}, field.name, input);
}

function showMethodFields() {
  const name = document.getElementById("method").value;
  const entry = methodEntry(name);
  if (!state.arguments[name]) {
    state.arguments[name] = {};
    for (const field of entry.fields) state.arguments[name][field.name] = field.default;
  }
  document.getElementById("method-fields").replaceChildren(...entry.fields.map((f) => fieldInput(name, f)));
}

function showScoreHint() {
  const score = document.getElementById("score").value;
  document.getElementById("contrast-box").hidden = score !== "contrast";
  const hints = {
    logit: "each token's logit (what LRP conserves)",
    log_prob: "each token's log-probability (Captum's LLM target)",
    contrast: "logit(token) − logit(foil): one foil token for every step, or one per generated token",
  };
  document.getElementById("score-hint").textContent = hints[score] || "";
}

function requestBody() {
  const method = document.getElementById("method").value;
  const score = document.getElementById("score").value;
  const body = {
    prompt: document.getElementById("prompt").value,
    max_new_tokens: Number(document.getElementById("max-new-tokens").value),
    methods: [{ name: method, arguments: { ...state.arguments[method] } }],
    score,
  };
  if (score === "contrast") body.contrast = document.getElementById("contrast").value;
  return body;
}

// -- jobs ---------------------------------------------------------------------------------------
function showCancel(jobId) {
  state.job = jobId;
  document.getElementById("cancel-job").hidden = !jobId;
}

function cancelJob(jobId) {
  if (!jobId) return Promise.resolve();
  return api(`api/jobs/${encodeURIComponent(jobId)}/cancel`, {}).catch(() => {});
}

function regenerate() { if (state.result) generate(); }  // a control changed: explain the same prompt again

async function generate() {
  const seq = ++state.seq;
  if (state.job) { cancelJob(state.job); showCancel(null); }  // replaced by this request
  showError("");
  const body = requestBody();
  const started = performance.now();
  setStatus("generating…", 0, null);
  try {
    let job = await api("api/generate", body);
    if (seq !== state.seq) { if (job.state === "running") cancelJob(job.id); return; }
    if (job.state === "running") showCancel(job.id);
    while (job.state === "running") {
      if (seq !== state.seq) return;
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      const doing = job.cancel_requested ? "cancelling" : job.queued_behind ? `waiting for ${job.queued_behind}` :
        `generating and explaining with ${job.running || body.methods[0].name}`;
      setStatus(`${doing}, ${seconds} s`, job.done, job.total);
      await new Promise((resolve) => setTimeout(resolve, 100));
      job = await api(`api/jobs/${encodeURIComponent(job.id)}`);
    }
    if (state.job === job.id) showCancel(null);
    if (seq !== state.seq) return;
    if (job.state === "error") throw new Error(job.error);
    if (job.state === "cancelled") { setStatus("cancelled"); return; }
    state.request = body;
    state.result = job.results[0].result;
    render();
    setStatus(`ready: ${state.result.output_tokens.length} token(s) explained by ${body.methods[0].name} in ` +
      `${((performance.now() - started) / 1000).toFixed(2)} s`);
  } catch (error) {
    if (seq !== state.seq) return;
    setStatus("error");
    showError(error.message);
  }
}

// -- the view -----------------------------------------------------------------------------------
function tokenSpans(box, tokens) {
  box.replaceChildren(...tokens.map((token, i) => el("span", { class: "token", "data-pos": String(i), text: token })));
}

function number(value) { return typeof value === "number" ? value : NaN; }  // "NaN"/"Infinity" as written

function render() {
  const result = state.result;
  const shares = result.first_token_share.values, scores = result.scores.values;
  const output = document.getElementById("output");
  output.replaceChildren();
  result.output_tokens.forEach((token, t) => {
    const chip = el("button", { type: "button", class: "chip", "data-step": String(t) },
      el("span", { text: token }), el("small", { text: `first ${number(shares[t]).toFixed(2)}` }));
    chip.title = `${result.score_kind} ${number(scores[t]).toPrecision(4)}; first-token share ` +
      `${number(shares[t]).toFixed(3)}`;
    chip.addEventListener("click", () => select(t));
    output.append(chip);
  });
  document.getElementById("answer-note").textContent =
    `(${result.output_tokens.length} token(s), ${result.method}, score ${result.score_kind})`;
  tokenSpans(document.getElementById("prompt-view"), result.input_tokens);
  tokenSpans(document.getElementById("output-view"), result.target_attr_tokens);
  drawLegend(result.signed);
  document.getElementById("export-json").disabled = false;
  document.getElementById("export-html").disabled = false;
  const step = state.step !== null && state.step < result.output_tokens.length ? state.step : null;
  state.step = null;
  if (step !== null) select(step);
  else document.getElementById("explained").textContent = "(click an output token)";
  document.body.dataset.generated = String(Number(document.body.dataset.generated || 0) + 1);
}

function paint(span, value, scale) {
  span.style.backgroundColor = rgb(value / scale);
  span.title = Number.isFinite(value) ? value.toPrecision(3) : String(value);
}

function select(t) {  // recolour from the loaded rows: token_attr[t] over the prompt, target_attr[t][:t] over the output
  const result = state.result;
  const promptRow = result.token_attr.values[t].map(number);
  const earlier = result.target_attr.values[t].map(number).slice(0, t);
  let scale = 0;
  for (const v of promptRow.concat(earlier)) if (Math.abs(v) > scale) scale = Math.abs(v);
  scale = scale || 1;
  document.querySelectorAll("#prompt-view .token").forEach((span, i) => paint(span, promptRow[i], scale));
  document.querySelectorAll("#output-view .token").forEach((span, j) => {
    span.classList.toggle("current", j === t);
    span.classList.toggle("later", j > t);
    if (j < t) paint(span, earlier[j], scale);
    else { span.style.backgroundColor = ""; span.title = j === t ? "the explained token" : "not read yet"; }
  });
  document.querySelectorAll("#output .chip").forEach((chip, j) => chip.classList.toggle("selected", j === t));
  document.getElementById("explained").textContent = `of output token ${t + 1}, "${result.output_tokens[t]}"`;
  state.step = t;
  state.recolours += 1;
  document.body.dataset.step = String(t);
  document.body.dataset.recolours = String(state.recolours);
}

// -- exports ------------------------------------------------------------------------------------
function exportJson() {
  if (!state.result) return;
  const view = { model: state.session.model, request: state.request, result: state.result };
  download(new Blob([JSON.stringify(view, null, 1)], { type: "application/json" }),
    "captum_transformers_generation.json");
}

async function exportHtml() {
  if (!state.request) return;
  setStatus("writing HTML…");
  try {
    const answer = await api("api/generate/export", state.request);
    download(new Blob([answer.html], { type: "text/html" }), answer.filename);
    setStatus("exported HTML");
  } catch (error) { showError(error.message); }
}

// -- start --------------------------------------------------------------------------------------
async function start() {
  state.token = readToken();
  try {
    state.session = await loadSession();
  } catch (error) {
    setStatus("error");
    showError(error.message);
    return;
  }
  const session = state.session, bounds = session.bounds;
  document.getElementById("model-name").textContent = session.model;
  const methodSelect = document.getElementById("method");
  for (const method of session.methods) {
    methodSelect.append(el("option", { value: method.name,
      text: `${method.name}${method.signed ? " (signed)" : ""}` }));
  }
  methodSelect.value = session.defaults.method;
  methodSelect.addEventListener("change", () => { showMethodFields(); regenerate(); });
  showMethodFields();
  const scoreSelect = document.getElementById("score");
  for (const score of session.scores) scoreSelect.append(el("option", { value: score, text: score }));
  scoreSelect.addEventListener("change", () => {
    showScoreHint();
    if (scoreSelect.value !== "contrast" || document.getElementById("contrast").value) regenerate();
  });
  document.getElementById("contrast").addEventListener("change", regenerate);
  showScoreHint();
  const newTokens = document.getElementById("max-new-tokens");
  newTokens.max = String(bounds.max_new_tokens);
  newTokens.value = String(session.defaults.max_new_tokens);
  document.getElementById("prompt-bound").textContent =
    `at most ${bounds.max_prompt_tokens} prompt tokens and ${bounds.max_new_tokens} new tokens`;
  const samples = document.getElementById("samples");
  document.getElementById("samples-box").hidden = !session.samples.length;
  for (const sample of session.samples) {
    const button = el("button", { type: "button", class: "sample", text: sample });
    button.title = sample;
    button.addEventListener("click", () => { document.getElementById("prompt").value = sample; generate(); });
    samples.append(button);
  }
  if (session.samples.length) document.getElementById("prompt").value = session.samples[0];
  document.getElementById("generate").addEventListener("click", generate);
  document.getElementById("export-json").addEventListener("click", exportJson);
  document.getElementById("export-html").addEventListener("click", exportHtml);
  document.getElementById("cancel-job").addEventListener("click", () => {
    const jobId = state.job;
    showCancel(null);
    setStatus("cancelling…");
    cancelJob(jobId);
  });
  setStatus("type a prompt or pick a sample, then Generate");
  document.body.dataset.ready = "yes";
}

start();
