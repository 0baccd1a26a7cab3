// captum_transformers explorer page. Every string from the server (class names, tokens,
// method names, errors) is written with textContent, never as HTML. The session token comes
// once from the URL (?token=...), is kept in sessionStorage and sent as a header. Every URL is
// relative to the page, so the explorer also works behind a proxy that serves it under a path.
"use strict";

const state = {
  token: null, model: 0, session: null, selected: [], targets: {}, maps: {}, methods: {},
  curve: null, renders: 0, requestSeq: 0, job: null,
};

function svgEl(tag, attributes) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attributes || {})) node.setAttribute(key, value);
  return node;
}

function readToken() {
  const params = new URLSearchParams(window.location.search);
  const fromUrl = params.get("token");
  if (fromUrl) {
    sessionStorage.setItem("captum-explorer-token", fromUrl);
    window.history.replaceState(null, "", window.location.pathname);  // keep it out of screenshots
  }
  return sessionStorage.getItem("captum-explorer-token");
}

function withModel(path) {  // which of the served models (Captum Insights' list of models)
  return `${path}${path.includes("?") ? "&" : "?"}model=${state.model}`;
}

async function api(path, body) {
  path = withModel(path);
  const options = { headers: { "X-Explorer-Token": state.token || "" } };
  if (body !== undefined) {
    options.method = "POST";
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  const payload = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) throw new Error(payload.error || `HTTP ${response.status}`);
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

// -- colours --------------------------------------------------------------------------------
function diverging(t) {  // t in [-1, 1] -> [r, g, b] in 0..255: blue, white, red
  const p = Math.max(t, 0), n = Math.max(-t, 0);
  return [255 * (1 - 0.8 * n), 255 * (1 - 0.8 * (p + n)), 255 * (1 - 0.8 * p)];
}

function decodeRgb(example) {
  const bytes = atob(example.rgb);
  const out = new Uint8ClampedArray(example.width * example.height * 4);
  for (let i = 0, j = 0; i < bytes.length; i += 3, j += 4) {
    out[j] = bytes.charCodeAt(i); out[j + 1] = bytes.charCodeAt(i + 1); out[j + 2] = bytes.charCodeAt(i + 2);
    out[j + 3] = 255;
  }
  return out;
}

function imageCanvas(example) {
  const canvas = el("canvas", { width: example.width, height: example.height });
  canvas.getContext("2d").putImageData(new ImageData(decodeRgb(example), example.width, example.height), 0, 0);
  return canvas;
}

function overlayCanvas(example, map) {
  const [mh, mw] = map.shape, w = example.width, h = example.height;
  const scale = Math.max(Math.abs(map.low), Math.abs(map.high)) || 1;
  const rgb = decodeRgb(example);
  for (let y = 0; y < h; y++) {
    for (let x = 0; x < w; x++) {
      const v = map.values[Math.floor(y * mh / h) * mw + Math.floor(x * mw / w)] / scale;
      const c = diverging(v), k = (y * w + x) * 4;
      for (let ch = 0; ch < 3; ch++) rgb[k + ch] = 0.4 * rgb[k + ch] + 0.6 * c[ch];
    }
  }
  const canvas = el("canvas", { width: w, height: h, class: "map" });
  canvas.getContext("2d").putImageData(new ImageData(rgb, w, h), 0, 0);
  return canvas;
}

function tokenStrip(tokens, map) {
  const box = el("div", { class: "tokens" });
  const scale = map ? (Math.max(Math.abs(map.low), Math.abs(map.high)) || 1) : 1;
  tokens.forEach((token, i) => {
    const span = el("span", { text: token });
    if (map) {
      const c = diverging(map.values[i] / scale);
      span.style.backgroundColor = `rgb(${c.map(Math.round).join(",")})`;
      span.title = map.values[i].toPrecision(3);
    }
    box.append(span);
  });
  return box;
}

// -- method controls, generated from the catalog ---------------------------------------------
function argumentsOf(name) { return { ...state.methods[name].arguments }; }
function argumentsKey(args) {
  return JSON.stringify(Object.keys(args).sort().reduce((o, k) => { o[k] = args[k]; return o; }, {}));
}

function fieldInput(method, field) {
  let input;
  if (field.kind === "choice") {
    input = el("select", { "data-field": field.name });
    for (const choice of field.choices) input.append(el("option", { value: choice, text: choice }));
    input.value = field.default;
  } else if (field.kind === "boolean") {
    input = el("input", { type: "checkbox", "data-field": field.name });
    input.checked = !!field.default;
  } else {
    input = el("input", { type: "number", "data-field": field.name, step: field.kind === "integer" ? "1" : "0.05" });
    input.value = field.default === null ? "" : field.default;
  }
  input.addEventListener("change", () => {
    let value = input.value;
    if (field.kind === "boolean") value = input.checked;
    else if (field.kind !== "choice") value = value === "" ? (field.optional ? null : field.default) : Number(value);
    state.methods[method.name].arguments[field.name] = value;
    refresh();
  });
  return el("label", {}, field.name, input);
}

function buildMethodControls(defaults) {
  const box = document.getElementById("methods");
  for (const method of state.session.methods) {
    const args = {};
    for (const field of method.fields) args[field.name] = field.default;
    state.methods[method.name] = { enabled: defaults.includes(method.name), arguments: args };
    const check = el("input", { type: "checkbox", "data-method": method.name });
    check.checked = state.methods[method.name].enabled;
    const fields = el("div", { class: "fields" }, ...method.fields.map((f) => fieldInput(method, f)));
    fields.hidden = !check.checked;
    check.addEventListener("change", () => {
      state.methods[method.name].enabled = check.checked;
      fields.hidden = !check.checked;
      refresh();
    });
    box.append(el("div", { class: "method", "data-method-box": method.name }, el("label", {}, check, " ", method.name),
      fields));
  }
}

// -- gallery --------------------------------------------------------------------------------
function className(index) { return index === null || index === undefined ? "?" : state.session.classes[index]; }

function fillClassSelect(select) {
  select.append(el("option", { value: "all", text: "all" }));
  state.session.classes.forEach((name, i) => select.append(el("option", { value: String(i), text: name })));
  select.addEventListener("change", renderGallery);
}

function filteredExamples() {
  const label = document.getElementById("filter-label").value;
  const predicted = document.getElementById("filter-predicted").value;
  const correct = document.getElementById("filter-correct").value;
  let list = state.session.examples.filter((e) =>
    (label === "all" || e.labels.map(String).includes(label)) && (predicted === "all" || String(e.predicted) === predicted)
    && (correct === "all" || (correct === "yes" ? e.correct === true : e.correct === false)));
  const sort = document.getElementById("sort").value;
  if (sort === "margin-asc") list = [...list].sort((a, b) => a.margin - b.margin);
  if (sort === "margin-desc") list = [...list].sort((a, b) => b.margin - a.margin);
  return list;
}

function exampleCaption(e, short) {
  const parts = [`#${e.index} pred ${className(e.predicted)} (${e.probability.toFixed(2)})`];
  if (e.labels.length) parts.push(`true ${e.labels.map(className).join("+")}`);
  parts.push(`${short ? "m" : "margin"} ${e.margin.toFixed(2)}`);
  return parts.join(", ");
}

function renderGallery() {
  const gallery = document.getElementById("gallery");
  gallery.replaceChildren();
  const list = filteredExamples();
  document.getElementById("gallery-count").textContent = `(${list.length} of ${state.session.examples.length})`;
  if (!list.length) gallery.append(el("p", { class: "hint", text: "no example matches these filters" }));
  for (const e of list) {
    const visual = state.session.modality === "image" ? imageCanvas(e) : tokenStrip(e.tokens, null);
    const thumb = el("div", { class: "thumb", "data-example": String(e.index) }, visual,
      el("div", { class: "caption", text: exampleCaption(e, true) }));
    thumb.title = exampleCaption(e);
    if (state.selected.includes(e.index)) thumb.classList.add("selected");
    if (e.correct === false) thumb.classList.add("wrong");
    if (state.session.modality === "text") thumb.classList.add("text");
    thumb.addEventListener("click", () => {
      const at = state.selected.indexOf(e.index);
      if (at >= 0) state.selected.splice(at, 1); else state.selected.push(e.index);
      thumb.classList.toggle("selected");
      refresh();
    });
    gallery.append(thumb);
  }
}

// -- explanations ---------------------------------------------------------------------------
function enabledMethods() {
  return Object.keys(state.methods).filter((m) => state.methods[m].enabled)
    .map((name) => ({ name, arguments: argumentsOf(name) }));
}

function targetOf(index) {
  return state.targets[index] !== undefined ? state.targets[index] : state.session.examples[index].predicted;
}

function mapKey(method, args, index, target) { return `${method}|${argumentsKey(args)}|${index}|${target}`; }

// -- jobs: the one the grid waits for can be cancelled; a job the grid no longer shows is -----
function showCancel(jobId) {
  state.job = jobId;
  document.getElementById("cancel-job").hidden = !jobId;
}

function cancelJob(jobId) {  // the server stops it at its next forward pass
  if (!jobId) return Promise.resolve();
  return api(`api/jobs/${encodeURIComponent(jobId)}/cancel`, {}).catch(() => {});
}

async function refresh() {
  const seq = ++state.requestSeq;
  if (state.job) { cancelJob(state.job); showCancel(null); }  // replaced by this request
  const methods = enabledMethods();
  showError("");
  renderGrid();
  if (!methods.length || !state.selected.length) { setStatus("pick a method and an example"); return; }
  const targets = {};
  for (const index of state.selected) targets[String(index)] = targetOf(index);
  const started = performance.now();
  try {
    let job = await api("api/explain", { methods, targets });
    if (seq !== state.requestSeq) { if (job.state === "running") cancelJob(job.id); return; }
    if (job.state === "running") showCancel(job.id);
    while (job.state === "running") {
      if (seq !== state.requestSeq) return;  // a newer request replaced this one (and cancelled this job)
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      const doing = job.cancel_requested ? "cancelling" : job.queued_behind ? `waiting for ${job.queued_behind}` :
        `computing ${job.running || ""}`;
      setStatus(`${doing}: ${job.done}/${job.total} methods on ${state.selected.length} ` +
        `examples, ${seconds} s`, job.done, job.total);
      await new Promise((resolve) => setTimeout(resolve, 100));
      job = await api(`api/jobs/${job.id}`);
    }
    if (state.job === job.id) showCancel(null);
    if (job.state === "error") throw new Error(job.error);
    for (const result of job.results) {
      for (const [index, map] of Object.entries(result.maps)) {
        state.maps[mapKey(result.method, result.arguments, Number(index), map.target)] = map;
      }
    }
    if (seq !== state.requestSeq) return;
    if (job.state === "cancelled") {
      setStatus(`cancelled after ${job.done}/${job.total} methods`);
      renderGrid();
      return;
    }
    setStatus(`ready: ${methods.length} method(s) × ${state.selected.length} example(s) in ` +
      `${((performance.now() - started) / 1000).toFixed(2)} s`);
    renderGrid();
  } catch (error) {
    if (seq !== state.requestSeq) return;
    setStatus("error");
    showError(error.message);
  }
}

function renderGrid() {
  const grid = document.getElementById("grid");
  grid.replaceChildren();
  const methods = enabledMethods();
  const head = el("tr", {}, el("th", { text: "method" }));
  for (const index of state.selected) {
    const e = state.session.examples[index];
    const select = el("select", { "data-target-for": String(index) });
    state.session.classes.forEach((name, i) => select.append(el("option", { value: String(i), text: name })));
    select.value = String(targetOf(index));
    select.addEventListener("change", () => { state.targets[index] = Number(select.value); refresh(); });
    head.append(el("th", {}, el("div", { class: "caption", text: exampleCaption(e) }),
      el("label", {}, "explain ", select)));
  }
  grid.append(head);
  if (state.session.modality === "image" && state.selected.length) {
    const row = el("tr", {}, el("td", { class: "method-name", text: "input" }));
    for (const index of state.selected) {
      const canvas = imageCanvas(state.session.examples[index]);
      canvas.className = "map";
      row.append(el("td", {}, canvas));
    }
    grid.append(row);
  }
  for (const method of methods) {
    const signed = state.session.methods.find((m) => m.name === method.name)?.signed;
    const row = el("tr", { "data-row": method.name }, el("td", { class: "method-name", text: method.name },
      el("div", { class: "sign-note", "data-signed": signed ? "yes" : "no",
                  text: signed ? "signed: red for, blue against" : "unsigned: darker = more relevant, no direction" })));
    for (const index of state.selected) {
      const key = mapKey(method.name, method.arguments, index, targetOf(index));
      const map = state.maps[key];
      const cell = el("td", { "data-key": key, "data-ready": map ? "yes" : "no" });
      if (!map) cell.append(el("span", { class: "flat", text: "…" }));
      else if (map.all_zero) cell.append(el("div", { class: "flat", text: "all scores 0: nothing to draw" }));
      else if (state.session.modality === "image") {
        const canvas = overlayCanvas(state.session.examples[index], map);
        canvas.title = `${method.name} on #${index}, class ${className(map.target)}; click for curves`;
        canvas.addEventListener("click", () => showCurve(method, index, map.target));
        cell.append(canvas);
      } else cell.append(tokenStrip(state.session.examples[index].tokens, map));
      row.append(cell);
    }
    grid.append(row);
  }
  state.renders += 1;
  grid.dataset.renders = String(state.renders);
}

// -- curves (lineChart: explorer-charts.js) ---------------------------------------------------
async function showCurve(method, index, target) {
  const section = document.getElementById("curve-section");
  section.hidden = false;
  const box = document.getElementById("curve");
  box.replaceChildren(el("span", { text: "computing curves…" }));
  document.getElementById("curve-title").textContent =
    `${method.name} on #${index}, class ${className(target)}`;
  try {
    const curve = await api("api/curve", { method: method.name, arguments: method.arguments, example: index, target });
    state.curve = curve;
    box.replaceChildren(lineChart(`probability of ${className(target)}`, [
      { name: `deletion ${curve.deletion.auc.toFixed(3)}`, x: curve.x, y: curve.deletion.y, colour: "#d62728" },
      { name: `insertion ${curve.insertion.auc.toFixed(3)}`, x: curve.x, y: curve.insertion.y, colour: "#1f77b4" },
    ], `fraction of ${state.session.modality === "image" ? "pixels" : "tokens"} removed / inserted`, ""));
  } catch (error) {
    box.replaceChildren(el("span", { text: error.message }));
  }
}

async function showBenchmark() {
  const data = await api("api/benchmark");
  const metrics = Object.entries(data.metrics || {});
  if (!metrics.length) return;
  document.getElementById("benchmark-section").hidden = false;
  document.getElementById("benchmark-source").textContent = data.source;
  const box = document.getElementById("benchmark");
  for (const [metric, byMethod] of metrics) {
    const series = Object.entries(byMethod).map(([name, c]) => ({ name: `${name} ${c.auc.toFixed(1)}`, x: c.x, y: c.y }));
    const first = Object.values(byMethod)[0];
    box.append(lineChart(metric, series, first.x_label, first.y_label));
  }
}

// -- start ----------------------------------------------------------------------------------
async function start() {
  state.token = readToken();
  state.model = Number(sessionStorage.getItem("captum-explorer-model") || 0);
  try {
    state.session = await loadSession();
  } catch (error) {
    setStatus("error");
    showError(`${error.message}`);
    return;
  }
  document.getElementById("model-name").textContent = `${state.session.model} (${state.session.examples.length} ` +
    `${state.session.modality === "image" ? "images" : "texts"})`;
  const models = state.session.models || [];
  if (models.length > 1) {  // switching model reloads the page for that model (token and choice kept)
    const select = document.getElementById("model-select");
    models.forEach((name, i) => select.append(el("option", { value: String(i), text: name })));
    select.value = String(state.model);
    select.addEventListener("change", () => {
      sessionStorage.setItem("captum-explorer-model", select.value);
      window.location.reload();
    });
    document.getElementById("model-choice").hidden = false;
  }
  buildMethodControls(state.session.defaults.methods);
  fillClassSelect(document.getElementById("filter-label"));
  fillClassSelect(document.getElementById("filter-predicted"));
  for (const id of ["filter-correct", "sort"]) document.getElementById(id).addEventListener("change", renderGallery);
  state.selected = [...state.session.defaults.examples];
  renderGallery();
  document.body.dataset.galleryMs = performance.now().toFixed(1);  // read by benchmarks/explorer_first_view.py
  document.getElementById("export-png").addEventListener("click", exportPng);
  document.getElementById("export-json").addEventListener("click", exportJson);
  document.getElementById("export-html").addEventListener("click", exportHtml);
  document.getElementById("cancel-job").addEventListener("click", () => {
    const jobId = state.job;
    showCancel(null);
    setStatus("cancelling…");
    cancelJob(jobId);
  });
  await refresh();
  showBenchmark().catch((error) => showError(error.message));
  document.body.dataset.readyMs = performance.now().toFixed(1);
  document.body.dataset.ready = "yes";
}

start();
