// What both explorer pages (classifier: index.html, generation: generation.html) share: DOM
// building from text nodes only (no markup strings), the status line and progress bar, the error
// box, and file downloads. Loaded before each page's own script.
"use strict";

function el(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes || {})) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);  // strings become text nodes
  return node;
}

function setStatus(text, done, total) {  // total undefined: no bar; null: a bar with no known end
  document.getElementById("status").textContent = text;
  const bar = document.getElementById("progress");
  bar.hidden = total === undefined;
  if (total === null) bar.removeAttribute("value");
  else if (total !== undefined) { bar.max = Math.max(total, 1); bar.value = done; }
}

function showError(message) {
  const box = document.getElementById("error");
  box.hidden = !message;
  box.textContent = message || "";
}

function download(blob, filename) {
  const link = el("a", { download: filename });
  link.href = URL.createObjectURL(blob);
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}
