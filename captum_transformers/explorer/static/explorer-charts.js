// captum_transformers explorer page: line charts as SVG (per-example and benchmark curves). Loaded before explorer.js; every
// string is written with textContent (see explorer.js).
"use strict";

const PALETTE = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
  "#7f7f7f", "#bcbd22", "#393b79", "#637939", "#843c39"];

function lineChart(title, series, xLabel, yLabel) {
  const width = 400, height = 210, left = 38, bottom = 30, top = 20, right = 160;
  const svg = svgEl("svg", { width, height, class: "chart" });
  const xs = series.flatMap((s) => s.x), ys = series.flatMap((s) => s.y).filter((v) => Number.isFinite(v));
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(0, ...ys), y1 = Math.max(1e-9, ...ys);
  const px = (x) => left + (x - x0) / ((x1 - x0) || 1) * (width - left - right);
  const py = (y) => height - bottom - (y - y0) / ((y1 - y0) || 1) * (height - bottom - top);
  svg.append(svgEl("rect", { x: left, y: top, width: width - left - right, height: height - bottom - top,
    fill: "none", stroke: "#bbb" }));
  const label = (text, x, y, anchor) => {
    const t = svgEl("text", { x, y, "text-anchor": anchor || "start" }); t.textContent = text; svg.append(t);
  };
  label(yLabel ? `${title} (${yLabel})` : title, left, 12);
  label(xLabel, left + (width - left - right) / 2, height - 4, "middle");
  label(String(x0), left, height - bottom + 12, "middle");
  label(String(x1), width - right, height - bottom + 12, "middle");
  label(y1.toFixed(2), left - 4, top + 8, "end");
  label(y0.toFixed(2), left - 4, height - bottom, "end");
  series.forEach((s, i) => {
    const colour = s.colour || PALETTE[i % PALETTE.length];
    const points = s.x.map((x, k) => `${px(x).toFixed(1)},${py(s.y[k]).toFixed(1)}`).join(" ");
    svg.append(svgEl("polyline", { points, fill: "none", stroke: colour, "stroke-width": 1.6 }));
    label(s.name, width - right + 6, top + 12 + 13 * i);
    svg.lastChild.setAttribute("fill", colour);
  });
  return svg;
}

