// captum_transformers explorer page: exports of the current view (PNG, JSON, HTML). Loaded before explorer.js; every
// string is written with textContent (see explorer.js).
"use strict";

function currentView() {
  const methods = enabledMethods();
  const view = { model: state.session.model, classes: state.session.classes, methods: [], examples: [] };
  for (const index of state.selected) {
    const e = state.session.examples[index];
    view.examples.push({ index, labels: e.labels, predicted: e.predicted, probability: e.probability,
      margin: e.margin, target: targetOf(index), tokens: e.tokens });
  }
  for (const method of methods) {
    const maps = {};
    for (const index of state.selected) {
      const map = state.maps[mapKey(method.name, method.arguments, index, targetOf(index))];
      if (map) maps[index] = map;
    }
    view.methods.push({ name: method.name, arguments: method.arguments, maps });
  }
  return view;
}

function exportJson() {
  download(new Blob([JSON.stringify(currentView(), null, 1)], { type: "application/json" }),
    "captum_transformers_explorer.json");
}

function exportPng() {
  const cells = [...document.querySelectorAll("#grid tr")].map((row) => [...row.querySelectorAll("canvas")]);
  const rows = cells.filter((r) => r.length);
  if (!rows.length) { showError("nothing to export: the grid has no image maps yet."); return; }
  const size = 112, pad = 4, columns = Math.max(...rows.map((r) => r.length));
  const out = el("canvas", { width: columns * (size + pad), height: rows.length * (size + pad) });
  const context = out.getContext("2d");
  context.imageSmoothingEnabled = false;
  context.fillStyle = "#fff"; context.fillRect(0, 0, out.width, out.height);
  rows.forEach((r, i) => r.forEach((c, j) => context.drawImage(c, j * (size + pad), i * (size + pad), size, size)));
  out.toBlob((blob) => download(blob, "captum_transformers_explorer.png"), "image/png");
}

async function exportHtml() {
  const methods = enabledMethods();
  if (!methods.length || !state.selected.length) { showError("nothing to export: pick methods and examples."); return; }
  const targets = {};
  for (const index of state.selected) targets[String(index)] = targetOf(index);
  setStatus("writing HTML…");
  try {
    const result = await api("api/export", { methods, targets });
    download(new Blob([result.html], { type: "text/html" }), result.filename);
    setStatus("exported HTML");
  } catch (error) { showError(error.message); }
}

