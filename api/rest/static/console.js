// The raytron console: login, the jobs page (live list, submit, plan, cancel) and a job page
// (curves: the history downsampled once, then each new point from the SSE event stream; events,
// log tail, placement map). Nothing is fetched twice: a page opened on a long run asks for a few
// hundred points of its history, not for every iteration. Routes live in the
// URL fragment (#/, #/jobs/ID); the token never does.

import { API, ApiError, followEvents, followLog, getJSON, postJSON, request, setOnUnauthorized, token } from "./api.js";
import { drawChart } from "./plot.js";
import { colourChoices, drawPlacement, listSpares } from "./placement.js";

const $ = (sel, root = document) => root.querySelector(sel);
const POLL_MS = 1500;
const HISTORY_POINTS = 1000;  // points of a job's history drawn when its page opens
let view = null;  // the live view's AbortController: leaving a page stops its streams and polls
let terminal = null;  // the final job states (a Set), from GET /api/v1/job-states: asked once per page load

/** The final job states, as the API names them (a job in one cannot be cancelled). */
function terminalStates() {
  terminal ??= getJSON(`${API}/job-states`).then((s) => new Set(s.terminal))
    .catch((err) => { terminal = null; throw err; });  // asked again next time (e.g. after the login)
  return terminal;
}

// ---- small helpers -------------------------------------------------------------------------------

function show(id) {
  for (const s of document.querySelectorAll("main > section")) s.hidden = s.id !== id;
}

function age(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 90) return `${s}s`;
  if (s < 5400) return `${Math.round(s / 60)}m`;
  if (s < 172800) return `${Math.round(s / 3600)}h`;
  return `${Math.round(s / 86400)}d`;
}

const sizesText = (sizes) => (sizes ? ["tp", "pp", "dp", "cp", "ep"].map((k) => `${k}${sizes[k] ?? 1}`).join(" ") : "");
const lossText = (v) => (v === undefined || v === null ? "" : v.toFixed(4));
const bytes = (n) => (n >= 2 ** 30 ? `${(n / 2 ** 30).toFixed(2)} GiB` : n >= 2 ** 20 ? `${(n / 2 ** 20).toFixed(2)} MiB`
  : `${(n / 1024).toFixed(1)} KiB`);

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function stateBadge(el, state) {
  el.textContent = state;
  el.className = `state ${state}`;
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true });
  });
}

// ---- login ---------------------------------------------------------------------------------------

function showLogin(message = "") {
  if (view) view.abort();
  show("login-view");
  $("#logout").hidden = true;
  $("#login-error").textContent = message;
  $("#token").focus();
}

$("#login-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  token.set($("#token").value.trim());
  $("#token").value = "";
  try {
    await getJSON(`${API}/cluster`);
  } catch (err) {
    token.clear();
    showLogin(err instanceof ApiError && err.status === 401 ? "Wrong token." : `Cannot reach the server: ${err.message}`);
    return;
  }
  route();
});

$("#logout").addEventListener("click", () => { token.clear(); me = null; $("#whoami").textContent = ""; showLogin(); });
setOnUnauthorized(() => { token.clear(); showLogin("The server refused the token; enter it again."); });

// ---- jobs page -----------------------------------------------------------------------------------

// One request per refresh: the list's summaries carry all a row shows (state, sizes, iteration,
// latest loss, restarts).
async function refreshJobs() {
  const [{ jobs }, final] = await Promise.all([getJSON(`${API}/jobs?limit=100`), terminalStates()]);
  const now = Date.now() / 1000;
  const body = $("#jobs tbody");
  const rows = new Map([...body.rows].map((r) => [r.dataset.jobId, r]));
  // Rows are kept and only redrawn when their job changed: a button must not vanish under a click.
  const shown = jobs.map((j) => {
    const row = rows.get(j.id) || document.createElement("tr");
    const sig = JSON.stringify([j.state, j.iteration, j.loss, j.restarts, j.sizes, me?.admin]);
    if (row.dataset.sig !== sig) fillJobRow(row, j, sig, final);
    row.cells[7].textContent = age(now - j.submitted_at);
    return row;
  });
  body.replaceChildren(...shown);  // moves kept rows; nothing in them is rebuilt
  $("#jobs-empty").hidden = jobs.length > 0;
}

const COLUMNS = ["state-cell", "name", "id muted", "sizes", "num iter", "num loss", "num restarts", "num age", "actions",
                 "owner-col"];
let me = null;  // GET /api/v1/me: who is logged in (an admin sees every job, with its owner)

/** Fill a job's row in place: its cells, link and button are made once and then only updated. */
function fillJobRow(row, j, sig, final) {
  if (!row.cells.length) {
    for (const cls of COLUMNS) cell(row, "", cls);
    row.cells[0].append(document.createElement("span"));
    row.cells[1].append(Object.assign(document.createElement("a"), { href: `#/jobs/${j.id}` }));
    row.cells[2].textContent = j.id.slice(0, 12);
    const button = Object.assign(document.createElement("button"), { type: "button", className: "danger cancel",
                                                                     textContent: "Cancel" });
    button.addEventListener("click", () => cancel(j.id).then(refreshJobs).catch(alertError));
    // Ticked jobs are compared (#/compare/A,B,...) from the button under the table.
    const pick = Object.assign(document.createElement("input"), { type: "checkbox", className: "pick",
                                                                  title: "compare this job's curves" });
    pick.addEventListener("change", updateCompareButton);
    row.cells[8].append(button, pick);
  }
  Object.assign(row.dataset, { jobId: j.id, state: j.state, sig });
  stateBadge(row.cells[0].firstChild, j.state);
  row.cells[1].firstChild.textContent = j.name;
  row.cells[3].textContent = sizesText(j.sizes);
  row.cells[4].textContent = `${j.iteration} / ${j.train_iters}`;
  row.cells[5].textContent = lossText(j.loss);
  row.cells[6].textContent = String(j.restarts);
  row.cells[9].textContent = j.owner || "";
  row.cells[9].hidden = !me?.admin;
  row.cells[8].firstChild.hidden = final.has(j.state);
}

function pickedJobs() {
  return [...document.querySelectorAll("#jobs tbody tr")].filter((r) => r.querySelector("input.pick")?.checked)
    .map((r) => r.dataset.jobId);
}

function updateCompareButton() {
  const n = pickedJobs().length;
  $("#compare-picked").disabled = n < 2;
  $("#compare-picked").textContent = n < 2 ? "Compare (tick two or more jobs)" : `Compare ${n} jobs`;
}

$("#compare-picked").addEventListener("click", () => { location.hash = `#/compare/${pickedJobs().join(",")}`; });

function alertError(err) {
  $("#spec-message").textContent = err.message;
  $("#spec-message").className = "error";
}

async function cancel(jobId) {
  await request(`${API}/jobs/${jobId}/cancel`, { method: "POST" });
}

async function pollJobs(signal) {
  while (!signal.aborted) {
    try { await refreshJobs(); } catch (err) { if (err instanceof ApiError && err.status === 401) return; }
    await sleep(POLL_MS, signal);
  }
}

/** The spec in the text box as an object: JSON as is, anything else through the server's YAML reader. */
async function specFromText() {
  const text = $("#spec").value;
  if (/^\s*[{[]/.test(text)) {
    try { return JSON.parse(text); } catch { /* YAML reads most JSON typos more kindly: fall through */ }
  }
  return (await (await request("/console/yaml", { method: "POST", body: text, raw: true })).json()).spec;
}

function showSpecErrors(err) {
  const list = $("#spec-errors");
  list.replaceChildren();
  $("#spec-message").className = "error";
  $("#spec-message").textContent = err.body?.code === "invalid_spec"
    ? `The spec has ${err.body.errors?.length || 1} problem(s):` : err.message;
  for (const p of err.body?.errors || []) {
    const li = list.appendChild(document.createElement("li"));
    li.dataset.field = p.field;
    li.innerHTML = "<code></code>: <span></span>";
    li.firstChild.textContent = p.field;
    li.lastChild.textContent = p.message;
  }
}

function clearSpecMessages() {
  delete $("#spec-message").dataset.jobId;
  $("#spec-errors").replaceChildren();
  $("#spec-message").textContent = "";
  $("#spec-message").className = "";
}

$("#spec-file").addEventListener("change", async (e) => {
  const file = e.target.files[0];
  if (file) $("#spec").value = await file.text();
  $("#plan-view").hidden = true;  // a plan shown is the plan of the text above it
});
$("#spec").addEventListener("input", () => { $("#plan-view").hidden = true; });

$("#submit-btn").addEventListener("click", async () => {
  clearSpecMessages();
  try {
    const job = await postJSON(`${API}/jobs`, await specFromText());
    $("#spec-message").textContent = `Submitted ${job.name} (${job.id}): ${job.state}`;
    $("#spec-message").dataset.jobId = job.id;
    await refreshJobs();
  } catch (err) {
    showSpecErrors(err);
  }
});

$("#plan-btn").addEventListener("click", async () => {
  clearSpecMessages();
  try {
    showPlan(await postJSON(`${API}/plan`, await specFromText()));
  } catch (err) {
    $("#plan-view").hidden = true;
    showSpecErrors(err);
  }
});

function showPlan(plan) {
  $("#plan-view").hidden = false;
  $("#plan-title").textContent = plan.name;
  $("#plan-summary").textContent = `${plan.world_size} ranks on ${plan.num_nodes} node(s) x ${plan.gpus_per_node} GPUs; ` +
    `${sizesText(plan.sizes)}; order ${plan.order}; ${plan.model_parameters.toLocaleString()} parameters`;
  setupMap($("#plan-view .colour-by"), $("#plan-map"), plan.placement, plan.gpus_per_node);
  const traffic = $("#plan-traffic");
  traffic.innerHTML = "<tr><th>kind</th><th class=num>in-node</th><th class=num>cross-node</th></tr>";
  for (const [kind, t] of Object.entries(plan.traffic)) {
    const row = traffic.insertRow();
    row.dataset.kind = kind;
    cell(row, kind);
    cell(row, bytes(t.in_node), "num in-node").dataset.bytes = t.in_node;
    cell(row, bytes(t.cross_node), "num cross-node").dataset.bytes = t.cross_node;
  }
  const memory = $("#plan-memory");
  memory.innerHTML = "<tr><th>rank</th><th class=num>parameters</th><th class=num>total</th>" +
    "<th class=num>with distributed optimizer</th></tr>";
  for (const m of plan.memory) {
    const row = memory.insertRow();
    row.dataset.rank = m.rank;
    cell(row, String(m.rank));
    cell(row, m.parameters.toLocaleString(), "num");
    cell(row, bytes(m.total_bytes), "num total").dataset.bytes = m.total_bytes;
    cell(row, bytes(m.total_bytes_distributed), "num");
  }
}

/** Fill a colour-by select for `ranks` and (re)draw the map (and the hot `spares`) whenever it changes. */
function setupMap(select, container, ranks, gpusPerNode, spares = []) {
  const previous = select.value;
  const choices = colourChoices(ranks);
  select.replaceChildren(...choices.map(([value, label]) => new Option(label, value)));
  if (choices.some(([v]) => v === previous)) select.value = previous;
  const draw = () => drawPlacement(container, ranks, { gpusPerNode, colourBy: select.value || "group:tp", spares });
  select.onchange = draw;
  draw();
}

// ---- job page ------------------------------------------------------------------------------------

// Series drawn when a job reports them (keys of its iteration events); losses share one chart.
const CHARTS = [
  { title: "loss", series: [["loss", "#2f6fdf"], ["val_loss", "#e67e22"], ["mtp_loss", "#9b59b6"]] },
  { title: "learning rate", series: [["lr", "#16a085"]] },
  { title: "grad norm", series: [["grad_norm", "#8e44ad"]] },
  { title: "loss scale", series: [["loss_scale", "#7f8c8d"]] },
  { title: "MoE aux loss", series: [["moe_aux_loss", "#c0392b"]] },
  { title: "throughput (tokens/s)", series: [["tokens_per_s", "#27ae60"]] },
  { title: "loss tokens per step (chat data)", series: [["loss_tokens", "#d35400"]] },
  { title: "packing efficiency (chat data)", series: [["packing_efficiency", "#2c3e50"], ["loss_token_share", "#7f8c8d"]] },
];

async function showJob(jobId, signal) {
  show("job-view");
  for (const id of ["#job-name", "#job-id", "#job-iter", "#job-restarts", "#job-sizes", "#job-error"]) $(id).textContent = "";
  $("#charts").replaceChildren();
  $("#events").replaceChildren();
  $("#logs").textContent = "";
  $("#placement-map").replaceChildren();
  const [job, final] = await Promise.all([getJSON(`${API}/jobs/${jobId}`), terminalStates()]);
  const metrics = new Map();  // iteration -> that iteration's metrics (the latest attempt's wins)
  const attemptOf = new Map();  // iteration -> the attempt that ran it (restarts and resizes begin where it changes)
  let placedAt = null;
  // The history as it is now: downsampled curves and the events but the iterations; the stream
  // below starts after job.last_seq, so it brings only what is new.
  const [history, past] = await Promise.all([
    getJSON(`${API}/jobs/${jobId}/metrics?points=${HISTORY_POINTS}`),
    getJSON(`${API}/jobs/${jobId}/events?exclude_kind=iteration`),
  ]);
  history.iterations.forEach((it, i) => {
    const m = {};
    for (const name of job.metric_names) if (history[name]) m[name] = history[name][i];
    metrics.set(it, m);
    attemptOf.set(it, history.attempt[i]);
  });

  const render = (j) => {
    $("#job-name").textContent = j.name;
    $("#job-id").textContent = j.id;
    stateBadge($("#job-state"), j.state);
    $("#job-iter").textContent = `${j.iteration} / ${j.train_iters}`;
    $("#job-restarts").textContent = String(j.restarts);
    $("#job-sizes").textContent = sizesText(j.sizes);
    $("#job-error").textContent = j.error ? `${j.error.code || "error"}: ${j.error.message || ""}` : "";
    $("#job-cancel").hidden = final.has(j.state);
    $("#job-cancel").onclick = () => cancel(j.id).catch((err) => { $("#job-error").textContent = err.message; });
  };
  render(job);

  const drawCharts = () => {
    const rows = [...metrics.entries()].sort((a, b) => a[0] - b[0]);
    const marks = [];  // where a new attempt began: a restart or a resize
    for (let i = 1; i < rows.length; i++) {
      const a = attemptOf.get(rows[i][0]), b = attemptOf.get(rows[i - 1][0]);
      if (a != null && b != null && a !== b) marks.push(rows[i][0]);
    }
    const boxes = [];
    for (const chart of CHARTS) {
      // The loss scale moves only under fp16's dynamic scaling; elsewhere it is a flat 1.
      if (chart.series[0][0] === "loss_scale" && !job.spec?.training?.fp16) continue;
      const series = chart.series.map(([name, colour]) => ({
        name, colour, points: rows.filter(([, m]) => typeof m[name] === "number").map(([it, m]) => [it, m[name]]),
      })).filter((s) => s.points.length);
      if (!series.length) continue;
      const box = document.createElement("div");
      box.className = "chart";
      box.dataset.chart = chart.series[0][0];
      drawChart(box, { title: chart.title, xMax: job.train_iters, series, marks });
      boxes.push(box);
    }
    if (!boxes.length) boxes.push(Object.assign(document.createElement("p"), { className: "muted", textContent: "No iterations yet." }));
    $("#charts").replaceChildren(...boxes);
  };
  drawCharts();

  // The server puts the view together (each rank's node, slot and coordinates); it is drawn as it comes.
  const drawMap = async () => {
    const placement = await getJSON(`${API}/jobs/${jobId}/placement`);
    $("#placement-note").textContent = placement.ranks.length
      ? `attempt ${placement.attempt}, as the ranks reported it` : "not placed yet";
    setupMap($("#job-view .colour-by"), $("#placement-map"), placement.ranks, placement.gpus_per_node,
      placement.spares || []);
    $("#placement-map").dataset.attempt = placement.attempt;
  };
  drawMap().catch(() => {});

  const seen = new Set();  // event seqs shown (the history and the stream may overlap by a few)
  const addEvent = (e) => {
    if (seen.has(e.seq)) return;
    seen.add(e.seq);
    const li = document.createElement("li");
    li.className = `ev-${e.kind}`;
    li.dataset.kind = e.kind;
    li.dataset.seq = e.seq;
    li.dataset.state = e.state;
    const when = new Date(e.time * 1000).toLocaleTimeString();
    li.innerHTML = "<time></time><span></span>";
    li.firstChild.textContent = when;
    const rank = e.kind === "failure" && e.data?.rank !== undefined && !/\brank\b/.test(e.message || "")
      ? ` (rank ${e.data.rank})` : "";
    li.lastChild.textContent = e.kind === "state" ? `${e.state}${e.message ? `: ${e.message}` : ""}`
      : `${e.kind}: ${e.message || ""}${rank}`;
    if (e.kind === "tracking" && /^https?:\/\//.test(e.data?.url || "")) {  // the job's tracker run
      const a = document.createElement("a");
      a.href = e.data.url;
      a.target = "_blank";
      a.rel = "noopener";
      a.textContent = " open the run";
      li.append(a);
    }
    $("#events").append(li);
  };

  let pending = false;
  const redraw = () => {  // many events arrive at once when a page opens late: draw once per frame
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; drawCharts(); });
  };

  for (const e of past.events) addEvent(e);
  let attempt = job.attempts.length || null;  // the attempt that runs the iterations streamed next

  followEvents(jobId, async (kind, e) => {
    if (kind === "end") {
      render(await getJSON(`${API}/jobs/${jobId}`));
      drawCharts();
      $("#charts").dataset.complete = "true";
      return;
    }
    if (kind === "iteration") {
      metrics.set(e.data.iteration, e.data);
      attemptOf.set(e.data.iteration, attempt);
      redraw();
      $("#job-iter").textContent = `${e.data.iteration} / ${job.train_iters}`;
      return;
    }
    addEvent(e);
    if (kind === "state" && e.state === "STARTING") attempt = (attempt || 0) + 1;
    if (kind === "placement" && e.time !== placedAt) { placedAt = e.time; drawMap().catch(() => {}); }
    if (kind === "state") render(await getJSON(`${API}/jobs/${jobId}`));
  }, signal, job.last_seq);

  const logs = $("#logs");
  let text = "";
  followLog(jobId, (chunk) => {
    text = (text + chunk).split("\n").slice(-400).join("\n");  // a tail: the last 400 lines
    const atEnd = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 8;
    logs.textContent = text;
    if (atEnd) logs.scrollTop = logs.scrollHeight;
  }, signal);
}

// ---- compare view (#/compare/ID,ID,...) ------------------------------------------------------------

const PALETTE = ["#2f6fdf", "#e67e22", "#16a085", "#8e44ad", "#c0392b", "#7f8c8d", "#27ae60", "#d35400"];
const COMPARED = [["loss", "loss"], ["tokens_per_s", "throughput (tokens/s)"]];

/** Two or more jobs' curves on shared charts, each job one series, from one downsampled request per job. */
async function showCompare(ids) {
  show("compare-view");
  $("#compare-title").textContent = ids.join(" vs ");
  $("#compare-error").textContent = "";
  const curves = await Promise.all(ids.map((id) => getJSON(
    `${API}/jobs/${encodeURIComponent(id)}/metrics?points=${HISTORY_POINTS}&names=${COMPARED.map(([n]) => n).join(",")}`)));
  const boxes = COMPARED.map(([name, title]) => {
    const series = curves.map((c, k) => ({
      name: ids[k], colour: PALETTE[k % PALETTE.length],
      points: c.iterations.map((it, i) => [it, c[name][i]]).filter(([, v]) => typeof v === "number"),
    })).filter((s) => s.points.length);
    const box = document.createElement("div");
    box.className = "chart";
    box.dataset.chart = name;
    if (series.length) drawChart(box, { title, xMax: 0, series });
    return box;
  });
  $("#compare-charts").replaceChildren(...boxes);
}

$("#compare-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const others = $("#compare-with").value.split(",").map((x) => x.trim()).filter(Boolean);
  const current = $("#job-id").textContent;
  if (others.length) location.hash = `#/compare/${[current, ...others].join(",")}`;
});

// ---- routing -------------------------------------------------------------------------------------

async function route() {
  if (view) view.abort();
  if (!token.get()) return showLogin();
  view = new AbortController();
  $("#logout").hidden = false;
  getJSON(`${API}/me`).then((u) => {
    me = u;
    $("#whoami").textContent = `${u.name}${u.admin ? " (admin)" : ""}`;
    for (const th of document.querySelectorAll("th.owner-col")) th.hidden = !u.admin;
  }).catch(() => {});
  getJSON(`${API}/cluster`).then((c) => {
    $("#cluster").textContent = `${c.nodes.length} node(s), ${c.gpus_free} of ${c.gpus_total} GPU slots free, ` +
      `${c.queue_length} queued`;
    listSpares($("#cluster-spares"), c.spares || []);
  }).catch(() => {});
  const match = location.hash.match(/^#\/jobs\/([\w.-]+)/);
  const compare = location.hash.match(/^#\/compare\/([\w.,-]+)/);
  if (compare) {
    showCompare(compare[1].split(",").filter(Boolean)).catch((err) => {
      show("compare-view");
      $("#compare-error").textContent = err.message;
    });
  } else if (match) {
    showJob(match[1], view.signal).catch((err) => {
      show("job-view");
      $("#job-error").textContent = err.message;
    });
  } else {
    show("jobs-view");
    pollJobs(view.signal);
  }
}

window.addEventListener("hashchange", route);
route();
