// The placement map: one box per node, one slot per GPU inside it, each slot labelled with its
// rank and (tp, pp, dp, cp, ep) coordinates and coloured by a group kind or a coordinate.

export const KINDS = ["tp", "pp", "dp", "cp", "ep"];

// Ranks of one group share every coordinate of their generator but the group's own.
// Decoder groups (tp, cp, dp, pp) vary one decoder axis; an EP group varies ep at fixed
// (etp, expert_dp, pp), the expert generator's other axes (known from the plan only).
const GROUP_KEY = {
  tp: ["cp", "dp", "pp"], cp: ["tp", "dp", "pp"], dp: ["tp", "cp", "pp"], pp: ["tp", "cp", "dp"],
  ep: ["etp", "expert_dp", "pp"],
};

/** The colour-by choices for ranks that have these coordinates. */
export function colourChoices(ranks) {
  const has = (k) => ranks.length && ranks.every((r) => r[k] !== undefined && r[k] !== null);
  const out = [];
  for (const k of KINDS) if (GROUP_KEY[k].every(has) && has(k)) out.push([`group:${k}`, `${k.toUpperCase()} group`]);
  for (const k of KINDS) if (has(k)) out.push([`coord:${k}`, `${k} rank (coordinate)`]);
  return out;
}

/** The group (a string key) a rank belongs to for `choice` ("group:tp", "coord:pp", ...). */
export function groupOf(rank, choice) {
  const [mode, kind] = choice.split(":");
  return mode === "group" ? GROUP_KEY[kind].map((k) => `${k}${rank[k]}`).join("-") : `${kind}${rank[kind]}`;
}

function colour(i, n) {
  const hue = (i * 360) / Math.max(n, 1) + (i % 2) * 17;
  return `hsl(${hue.toFixed(0)} 70% ${i % 2 ? 78 : 84}%)`;
}

/**
 * Draw the map into `container`.
 * @param {HTMLElement} container
 * @param {object[]} ranks  one per rank: rank, node (id or index), local slot, tp/pp/dp/cp/ep (+etp, expert_dp)
 * @param {{gpusPerNode?: number, colourBy: string}} opts
 */
export function drawPlacement(container, ranks, { gpusPerNode, colourBy }) {
  const nodes = new Map();
  for (const r of ranks) {
    const node = String(r.node ?? r.node_id ?? r.hostname ?? "?");
    if (!nodes.has(node)) nodes.set(node, []);
    nodes.get(node).push(r);
  }
  const groups = [...new Set(ranks.map((r) => groupOf(r, colourBy)))].sort(
    (a, b) => a.localeCompare(b, undefined, { numeric: true }));
  const index = new Map(groups.map((g, i) => [g, i]));
  const boxes = [];
  for (const [node, members] of nodes) {
    const box = document.createElement("div");
    box.className = "node";
    box.dataset.node = node;
    const hosts = [...new Set(members.map((r) => r.node_id ?? r.hostname).filter(Boolean))];
    box.innerHTML = `<div class="node-title"></div><div class="slots"></div>`;
    box.firstChild.textContent = `node ${node}` + (hosts.length && hosts[0] !== node ? ` (${hosts.join(", ")})` : "");
    const slots = box.lastChild;
    const bySlot = new Map(members.map((r, i) => [r.local ?? i, r]));
    const count = Math.max(gpusPerNode || 0, ...[...bySlot.keys()].map((k) => k + 1));
    for (let s = 0; s < count; s++) {
      const r = bySlot.get(s);
      const slot = document.createElement("div");
      slot.className = r ? "slot" : "slot empty";
      slot.dataset.slot = s;
      if (r) {
        for (const k of ["rank", ...KINDS]) slot.dataset[k] = r[k];
        const group = groupOf(r, colourBy);
        slot.dataset.group = group;
        slot.style.background = colour(index.get(group), groups.length);
        slot.title = `rank ${r.rank} on node ${node}, slot ${s}` + (r.pid ? `, pid ${r.pid}` : "");
        slot.innerHTML = `<b>r${r.rank}</b> <span class="muted">gpu ${s}</span><br><span class="coords"></span>`;
        slot.querySelector(".coords").textContent = `(${KINDS.map((k) => r[k] ?? "-").join(",")})`;
      } else {
        slot.textContent = `gpu ${s}: free`;
      }
      slots.append(slot);
    }
    boxes.push(box);
  }
  const legend = document.createElement("div");
  legend.className = "muted";
  legend.style.flexBasis = "100%";
  legend.textContent = ranks.length ? `slot label: rank, then (${KINDS.join(", ")}); ${groups.length} colour(s)` : "not placed yet";
  container.replaceChildren(...boxes, legend);
}
