// A small line chart drawn as inline SVG (no library). Each series' polyline carries the plotted
// numbers in data-iterations / data-values (JSON), so a test can compare them with the API.

const NS = "http://www.w3.org/2000/svg";
const W = 600, H = 240, M = { left: 58, right: 14, top: 26, bottom: 28 };

function el(name, attrs = {}, text) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

/** Round numbers for the axis: 1, 2 or 5 times a power of ten. */
function ticks(lo, hi, count) {
  if (hi === lo) return [lo];
  const raw = (hi - lo) / count, pow = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * pow).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

const fmt = (v) => (Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(1) : +v.toPrecision(4)).toString();

/**
 * Draw (or redraw) a chart into `container`.
 * @param {HTMLElement} container
 * @param {{title: string, xMax: number, series: {name: string, colour: string, points: [number, number][]}[],
 *          marks?: number[]}} chart  marks: iterations where a new attempt began (a restart or a resize),
 *          drawn as dashed vertical lines
 */
export function drawChart(container, { title, xMax, series, marks = [] }) {
  const all = series.flatMap((s) => s.points);
  const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  svg.append(el("text", { x: M.left, y: 16, class: "legend", fill: "#1d2430" }, title));
  let lx = M.left + 8 * title.length + 16;
  for (const s of series.length > 1 || series[0]?.name !== title ? series : []) {
    svg.append(el("rect", { x: lx, y: 8, width: 14, height: 3, fill: s.colour }));
    svg.append(el("text", { x: lx + 18, y: 14, class: "legend" }, s.name));
    lx += 30 + 7 * s.name.length;
  }
  const x0 = 1, x1 = Math.max(2, xMax || 0, ...all.map((p) => p[0]));
  let y0 = Math.min(...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
  if (!all.length) { y0 = 0; y1 = 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.05 || 1; y1 += Math.abs(y1) * 0.05 || 1; }
  const pad = (y1 - y0) * 0.06;
  y0 -= pad; y1 += pad;
  const sx = (x) => M.left + ((x - x0) / (x1 - x0)) * (W - M.left - M.right);
  const sy = (y) => H - M.bottom - ((y - y0) / (y1 - y0)) * (H - M.top - M.bottom);
  for (const t of ticks(y0, y1, 4)) {
    svg.append(el("line", { x1: M.left, x2: W - M.right, y1: sy(t), y2: sy(t), class: "grid" }));
    svg.append(el("text", { x: M.left - 6, y: sy(t) + 4, "text-anchor": "end" }, fmt(t)));
  }
  for (const t of ticks(x0, x1, 6).filter((t) => Number.isInteger(t))) {
    svg.append(el("text", { x: sx(t), y: H - M.bottom + 16, "text-anchor": "middle" }, String(t)));
  }
  svg.append(el("line", { x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom, class: "axis" }));
  svg.append(el("line", { x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, class: "axis" }));
  svg.append(el("text", { x: W - M.right, y: H - 2, "text-anchor": "end" }, "iteration"));
  for (const x of marks) {
    const mark = el("line", { x1: sx(x), x2: sx(x), y1: M.top, y2: H - M.bottom, class: "attempt-mark",
                              stroke: "#c0392b", "stroke-dasharray": "4 3", "data-iteration": x });
    mark.append(el("title", {}, `a new attempt (restart or resize) from iteration ${x}`));
    svg.append(mark);
  }
  for (const s of series) {
    const line = el("polyline", {
      points: s.points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "),
      fill: "none", stroke: s.colour, "stroke-width": 2, "stroke-linejoin": "round",
      "data-series": s.name,
      "data-iterations": JSON.stringify(s.points.map((p) => p[0])),
      "data-values": JSON.stringify(s.points.map((p) => p[1])),
    });
    svg.append(line);
    if (s.points.length <= 60) {
      for (const [x, y] of s.points) {
        const dot = el("circle", { cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 2.5, fill: s.colour });
        dot.append(el("title", {}, `${s.name} @ ${x}: ${y}`));
        svg.append(dot);
      }
    }
  }
  container.replaceChildren(svg);
}
