// captum_transformers explorer: the store page. Pages, searches and sorts the rows of a corpus job's
// store on the server (the list holds one page at a time), and draws the clicked row's map: an image
// map on a canvas, a text map over its tokens, a generation's answer tokens (click one to colour its
// evidence in the prompt). Every string from the server (tokens, prompts, errors) is written with
// textContent, never as HTML. The session token comes once from the URL (?token=...), is kept in
// sessionStorage and sent as a header; URLs are relative.
"use strict";

const PAGE = 50;
const state = { token: null, session: null, offset: 0, matched: 0, seq: 0, selected: null, detail: null, step: 0 };

function readToken() {
  const fromUrl = new URLSearchParams(window.location.search).get("token");
  if (fromUrl) {
    sessionStorage.setItem("captum-explorer-token", fromUrl);
    window.history.replaceState(null, "", window.location.pathname);
  }
  return sessionStorage.getItem("captum-explorer-token");
}

async function api(path) {
  const response = await fetch(path, { headers: { "X-Explorer-Token": state.token || "" } });
  const payload = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) throw new Error(payload.error || `HTTP ${response.status}`);
  return payload;
}

// t in [-1, 1] -> blue (against), white (0), red (for), as on the other pages.
function diverging(t) {
  const p = Math.max(t, 0), n = Math.max(-t, 0);
  return [255 * (1 - 0.8 * n), 255 * (1 - 0.8 * (p + n)), 255 * (1 - 0.8 * p)].map(Math.round);
}
function scale(values) { return Math.max(1e-30, ...values.map((v) => Math.abs(v))); }

async function loadRows() {
  const seq = ++state.seq;
  const params = new URLSearchParams({
    q: document.getElementById("search").value, sort: document.getElementById("sort").value,
    order: document.getElementById("order").dataset.order, offset: String(state.offset), limit: String(PAGE),
  });
  const target = document.getElementById("target").value;
  if (target !== "") params.set("target", target);
  const started = performance.now();
  try {
    const page = await api(`api/rows?${params}`);
    if (seq !== state.seq) return;  // a later query superseded this one
    state.matched = page.matched;
    drawRows(page.rows);
    const last = Math.min(state.offset + PAGE, page.matched);
    document.getElementById("page-info").textContent = page.matched
      ? `rows ${state.offset + 1}–${last} of ${page.matched} matching (${state.session.rows} in the store)`
      : `no row matches (${state.session.rows} in the store)`;
    document.getElementById("previous").disabled = state.offset === 0;
    document.getElementById("next").disabled = last >= page.matched;
    setStatus(`ready (${Math.round(performance.now() - started)} ms)`);
    document.body.dataset.ready = "yes";
    showError(null);
  } catch (error) {
    showError(error.message);
  }
}

function drawRows(rows) {
  const body = document.querySelector("#rows tbody");
  body.replaceChildren(...rows.map((row) => {
    const line = el("tr", { "data-row": String(row.row_id) },
      el("td", { text: String(row.row_id) }),
      el("td", { text: row.target === null ? "" : String(row.target), class: "target-cell" }),
      el("td", { text: Number(row.score).toPrecision(4) }),
      el("td", { text: String(row.length), class: "text-cell" }),
      el("td", { text: row.text, class: "text text-cell" }));
    if (row.row_id === state.selected) line.classList.add("selected");
    line.addEventListener("click", () => openRow(row.row_id));
    return line;
  }));
  for (const cell of document.querySelectorAll(".target-cell")) cell.hidden = state.session.kind !== "classifier";
  for (const cell of document.querySelectorAll(".text-cell")) cell.hidden = !state.session.has_text;
}

async function openRow(rowId) {
  state.selected = rowId;
  for (const line of document.querySelectorAll("#rows tbody tr")) {
    line.classList.toggle("selected", Number(line.dataset.row) === rowId);
  }
  try {
    state.detail = await api(`api/rows/${rowId}`);
    state.step = 0;
    drawDetail();
    showError(null);
  } catch (error) {
    showError(error.message);
  }
}

function tokenSpans(tokens, values) {
  const top = scale(values);
  return el("div", { class: "tokens" }, ...tokens.map((token, i) => {
    const span = el("span", { text: token, title: `${token}: ${values[i].toPrecision(4)}` });
    span.style.background = `rgb(${diverging(values[i] / top).join(",")})`;
    return span;
  }));
}

function drawDetail() {
  const row = state.detail, body = document.getElementById("detail-body");
  const title = document.getElementById("detail-title");
  const note = document.getElementById("legend-note");
  note.textContent = "red: for the explained score, blue: against; each map scaled by its largest magnitude";
  if (state.session.kind === "generation") {
    title.textContent = `row ${row.row_id}: why the model wrote each token`;
    const outputs = el("div", { class: "outputs" }, ...row.output_tokens.map((token, t) => {
      const button = el("button", { type: "button", text: token, "data-step": String(t) });
      if (t === state.step) button.classList.add("selected");
      button.addEventListener("click", () => { state.step = t; drawDetail(); });
      return button;
    }));
    body.replaceChildren(
      el("p", { text: `answer (p = ${row.output_probs.map((p) => Number(p).toFixed(3)).join(", ")}):` }), outputs,
      el("p", { text: `evidence of “${row.output_tokens[state.step]}” in the prompt:` }),
      tokenSpans(row.input_tokens, row.token_attr[state.step]),
      el("p", { text: "and in the answer before it:" }),
      tokenSpans(row.target_attr_tokens, row.target_attr[state.step]));
    return;
  }
  title.textContent = `row ${row.row_id}: class ${row.target}, score ${Number(row.score).toPrecision(4)}`;
  if (row.tokens) {
    body.replaceChildren(tokenSpans(row.tokens, row.map.values));
    return;
  }
  const grid = row.map.grid, height = grid.length, width = grid[0].length;
  const canvas = el("canvas", { width: String(width), height: String(height), id: "map-canvas" });
  const context = canvas.getContext("2d"), image = context.createImageData(width, height);
  const top = scale(grid.flat());
  grid.flat().forEach((value, i) => {
    const [r, g, b] = diverging(value / top);
    image.data.set([r, g, b, 255], 4 * i);
  });
  context.putImageData(image, 0, 0);
  body.replaceChildren(canvas, el("p", { class: "hint", text: `map ${row.map.shape.join(" × ")}` }));
}

function requery() { state.offset = 0; loadRows(); }

async function main() {
  state.token = readToken();
  try {
    state.session = await api("api/session");
  } catch (error) {
    showError(error.message);
    setStatus("failed");
    return;
  }
  const s = state.session;
  document.getElementById("store-name").textContent = s.name;
  const m = s.manifest;
  document.getElementById("manifest").textContent =
    `${m.kind} store · ${m.method} on ${m.model_class} (${m.dtype}) · captum_transformers ${m.captum_transformers}, ` +
    `torch ${m.torch}` + (m.transformers ? `, transformers ${m.transformers}` : "");
  const sort = document.getElementById("sort");
  sort.replaceChildren(...s.sorts.map((name) => el("option", { value: name, text: name })));
  const target = document.getElementById("target");
  for (const value of s.targets) target.append(el("option", { value: String(value), text: String(value) }));
  document.getElementById("target-box").hidden = s.kind !== "classifier";
  document.getElementById("target-head").hidden = s.kind !== "classifier";
  document.getElementById("search-box").hidden = !s.has_text;  // an image store has no text to search
  let timer = null;
  document.getElementById("search").addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(requery, 200); });
  target.addEventListener("change", requery);
  sort.addEventListener("change", requery);
  document.getElementById("order").addEventListener("click", (event) => {
    const button = event.currentTarget;
    button.dataset.order = button.dataset.order === "asc" ? "desc" : "asc";
    button.textContent = button.dataset.order === "asc" ? "ascending" : "descending";
    requery();
  });
  document.getElementById("previous").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); loadRows(); });
  document.getElementById("next").addEventListener("click", () => { state.offset += PAGE; loadRows(); });
  await loadRows();
}

document.addEventListener("DOMContentLoaded", main);
