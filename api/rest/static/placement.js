// The placement map: one box per node, one slot per GPU inside it, each slot labelled with its
// rank and (tp, pp, dp, cp, ep) coordinates and coloured by a group kind or a coordinate; then
// one box per hot spare node (resources.spare_nodes), its idle rank actors up or starting.

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

/** [actors up, actors started] of some hot spare nodes. */
const actorsUp = (spares) => [spares.reduce((n, sp) => n + sp.ready, 0), spares.reduce((n, sp) => n + sp.actors, 0)];

/** A hot spare node's box: its actors, each up or still starting; free slots past them. */
function spareBox(spare, gpusPerNode) {
  const box = document.createElement("div");
  box.className = "node spare";
  box.dataset.spareBundle = spare.bundle;
  box.dataset.node = spare.node_id ?? "";
  box.dataset.actors = spare.actors;
  box.dataset.ready = spare.ready;
  box.innerHTML = `<div class="node-title"><span class="tag">spare</span> </div><div class="slots"></div>`;
  box.firstChild.append(spare.node_id ? `node ${spare.node_id}` : `bundle ${spare.bundle}, not placed yet`);
  box.title = `hot spare node (resources.spare_nodes): ${spare.ready} of ${spare.actors} idle rank actors up`;
  const count = Math.max(gpusPerNode || 0, spare.actors);
  for (let s = 0; s < count; s++) {
    const slot = document.createElement("div");
    const up = s < spare.ready;
    slot.className = s < spare.actors ? `slot spare-actor ${up ? "up" : "starting"}` : "slot empty";
    slot.dataset.slot = s;
    slot.textContent = s < spare.actors ? `gpu ${s}: spare, ${up ? "up" : "starting"}` : `gpu ${s}: free`;
    box.lastChild.append(slot);
  }
  return box;
}

/**
 * Draw the map into `container`.
 * @param {HTMLElement} container
 * @param {object[]} ranks  one per rank: rank, node (id or index), local slot, tp/pp/dp/cp/ep (+etp, expert_dp),
 *   spare (true: the rank restarted as a hot spare's actor)
 * @param {{gpusPerNode?: number, colourBy: string, spares?: object[]}} opts  spares: the hot spare
 *   nodes, as the placement view lists them (bundle, node_id, actors, ready)
 */
export function drawPlacement(container, ranks, { gpusPerNode, colourBy, spares = [] }) {
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
      slot.className = r ? (r.spare ? "slot from-spare" : "slot") : "slot empty";
      slot.dataset.slot = s;
      if (r) {
        for (const k of ["rank", ...KINDS]) slot.dataset[k] = r[k];
        const group = groupOf(r, colourBy);
        slot.dataset.group = group;
        slot.style.background = colour(index.get(group), groups.length);
        slot.dataset.spare = Boolean(r.spare);
        slot.title = `rank ${r.rank} on node ${node}, slot ${s}` + (r.pid ? `, pid ${r.pid}` : "") +
          (r.spare ? "; restarted on a hot spare node (was an idle spare actor)" : "");
        slot.innerHTML = `<b>r${r.rank}</b> <span class="muted">gpu ${s}</span><br><span class="coords"></span>` +
          (r.spare ? `<br><span class="tag">from spare</span>` : "");
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
  if (spares.length) {
    const [up, started] = actorsUp(spares);
    legend.textContent += `; ${spares.length} hot spare node(s), ${up} of ${started} spare actors up`;
  }
  if (ranks.some((r) => r.spare)) legend.textContent += `; "from spare": a rank restarted on a hot spare node`;
  container.replaceChildren(...boxes, ...spares.map((sp) => spareBox(sp, gpusPerNode)), legend);
}

/** The active jobs' hot spare nodes (GET /api/v1/cluster's spares) into `box`, per job: its spare
 * nodes and their actors up, linked to the job's page; `box` hidden when there are none. */
export function listSpares(box, spares) {
  const byJob = new Map();
  for (const sp of spares) {
    if (!byJob.has(sp.job_id)) byJob.set(sp.job_id, []);
    byJob.get(sp.job_id).push(sp);
  }
  const parts = [...byJob].map(([jobId, nodes]) => {
    const a = Object.assign(document.createElement("a"), { href: `#/jobs/${jobId}`, className: "spares-of" });
    const [up, started] = actorsUp(nodes);
    Object.assign(a.dataset, { jobId, nodes: nodes.length, ready: up, actors: started });
    a.textContent = `${jobId}: ${nodes.length} node(s), ${up}/${started} up`;
    a.title = "hot spare nodes (resources.spare_nodes): idle rank actors started and up";
    return a;
  });
  box.replaceChildren(...(parts.length ? ["hot spares: ", ...parts.flatMap((a, i) => (i ? ["; ", a] : [a]))] : []));
  box.hidden = !parts.length;
}
