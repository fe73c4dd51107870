/* kvgate live dashboard.
 *
 * Every state pushed on /admin/events is ingested at once (cheap: a few array appends);
 * drawing happens at most once per animation frame, so a burst of events or 64 nodes never
 * queues work. Rates are derived here from the gateway's cumulative counters, over a
 * trailing window. On connecting, the gateway first sends its `history` (one point a
 * second of the last minutes, in the state's shape, with its clock's `now`): each point is
 * ingested like a state, placed `now - time` seconds before this page's clock, so the
 * charts start with what happened before the tab was opened. Every key is read
 * defensively: a field the gateway does not (yet) send shows as "–", never as an error.
 */
(() => {
  "use strict";

  const PRIOS = ["critical", "standard", "sheddable"];
  const PRIO_COLOR = { critical: "#bc8cff", standard: "#39c5cf", sheddable: "#f0883e" };
  const AXIS = "#8a93a3";
  const GRID = "#262c36";
  const MAX_WINDOW_S = 300;
  const RATE_WINDOW_S = 2.0;   // admitted/rejected per second, over the last two seconds
  const SLOW_WINDOW_S = 5.0;   // Retry-After and cancellations are rarer: smooth more
  const REASON_WINDOW_S = 10.0;
  const SPARK_POINTS = 120;    // per-node KV history kept for the sparkline
  const NO_KEY = "(no key)"; // the tenant of a gateway without API keys
  const SEVERITY = { panic: 0, thrashing: 1, dead: 2, stale: 3, lagging: 4, high: 5, unknown: 6, ok: 7 };

  // ---------- small helpers ----------
  const $ = (id) => document.getElementById(id);
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const num = (v) => (isNum(v) ? v : null);
  const obj = (v) => (v && typeof v === "object" && !Array.isArray(v) ? v : null);

  /** Sum every number found under a value (a number, or nested dicts of numbers). */
  function sumLeaves(v) {
    if (isNum(v)) return v;
    const o = obj(v);
    if (!o) return 0;
    let s = 0;
    for (const k in o) s += sumLeaves(o[k]);
    return s;
  }

  function first(o, keys) {
    if (!o) return undefined;
    for (const k of keys) if (o[k] !== undefined && o[k] !== null) return o[k];
    return undefined;
  }

  function fmtNum(v, digits = 1) {
    if (!isNum(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(digits) + "M";
    if (a >= 1e4) return (v / 1e3).toFixed(digits) + "k";
    if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
    return v.toFixed(digits);
  }
  const fmtPct = (v) => (isNum(v) ? (v * 100).toFixed(0) + "%" : "–");
  const fmtMs = (s) => (isNum(s) ? (s * 1000 >= 100 ? (s * 1000).toFixed(0) : (s * 1000).toFixed(1)) + " ms" : "–");
  const fmtAge = (s) => (isNum(s) ? (s < 10 ? s.toFixed(1) : s.toFixed(0)) + " s" : "–");

  // ---------- reading the state (robust to missing keys) ----------

  /** Per-priority numbers from `{critical: n}` or `{critical: {reason: n}}`, or from
   * flat `"critical/reason"` / `"critical:reason"` keys. */
  function byPriority(v) {
    const out = { critical: 0, standard: 0, sheddable: 0 };
    const o = obj(v);
    if (!o) return out;
    for (const k in o) {
      const p = k.split(/[/:|,]/)[0].toLowerCase();
      if (p in out) out[p] += sumLeaves(o[k]);
    }
    return out;
  }

  /** Per-reason numbers from `{priority: {reason: n}}`, `{reason: n}` or flat keys. */
  function byReason(v) {
    const out = {};
    const o = obj(v);
    if (!o) return out;
    for (const k in o) {
      const inner = obj(o[k]);
      if (inner && PRIOS.includes(k.toLowerCase())) {
        for (const r in inner) out[r] = (out[r] || 0) + sumLeaves(inner[r]);
      } else {
        const parts = k.split(/[/:|,]/);
        const r = PRIOS.includes(parts[0].toLowerCase()) ? parts.slice(1).join("/") || parts[0] : k;
        out[r] = (out[r] || 0) + sumLeaves(o[k]);
      }
    }
    return out;
  }

  /** `{"decision|priority|reason": n}` (the gateway's telemetry counters) split into
   * admitted-by-priority, rejected-by-priority and rejected-by-reason. */
  function splitAdmissions(v) {
    const o = obj(v);
    if (!o) return null;
    const admitted = {}, rejected = {}, reasons = {};
    for (const k in o) {
      const [decision = "", prio = "", reason = "other"] = k.split("|");
      const n = sumLeaves(o[k]);
      if (/^(admit|accept)/i.test(decision)) {
        admitted[prio] = (admitted[prio] || 0) + n;
      } else {
        rejected[prio] = (rejected[prio] || 0) + n;
        reasons[reason] = (reasons[reason] || 0) + n;
      }
    }
    return { admitted, rejected, reasons };
  }

  function readCounters(state) {
    const c = obj(state.counters) || {};
    const split = splitAdmissions(c.admissions);
    const ra = first(c, ["retry_after", "retry_after_s"]);
    const raObj = obj(ra);
    const rejected = first(c, ["rejected", "rejected_total", "shed"]);
    const rejectedByReason = first(c, ["rejected_by_reason"]);
    const rej = split ? byPriority(split.rejected) : byPriority(rejected);
    return {
      admitted: split ? byPriority(split.admitted) : byPriority(first(c, ["admitted", "admitted_total"])),
      rejected: rej,
      reasons: split ? split.reasons : byReason(rejectedByReason !== undefined ? rejectedByReason : rejected),
      // Every shed answer carries a Retry-After: without a dedicated counter, count those.
      retryCount: num(first(c, ["retry_after_count", "retry_after_total"])) ??
        (raObj ? num(first(raObj, ["count", "total", "n"])) : null) ?? sumLeaves(rej),
      retryExact: first(c, ["retry_after_count", "retry_after_total"]) !== undefined || !!raObj,
      retrySum: num(first(c, ["retry_after_sum_s", "retry_after_seconds_sum", "retry_after_sum"])) ??
        (raObj ? num(first(raObj, ["sum_s", "sum", "seconds"])) : null),
      cancels: sumLeaves(first(c, ["cancellations", "cancelled", "client_cancellations", "cancels"])),
    };
  }

  // ---------- history ----------
  const hist = {
    t: [],
    adm: { critical: [], standard: [], sheddable: [] },
    rej: { critical: [], standard: [], sheddable: [] },
    queued: { critical: [], standard: [], sheddable: [] },
    oldest: [], used: [],
    kvRepMean: [], kvRepMax: [], kvPredMean: [], kvPredMax: [], setpoint: [],
    retryRate: [], retryMean: [], cancelRate: [],
  };
  const counterHist = []; // {t, c}
  const nodeHist = new Map(); // id -> {rep: number[], pred: number[]}
  let lastState = null;
  let lastNow = null;
  let lastServerT = null; // the gateway's time of the newest state or point ingested
  let historyPoints = 0;
  let updates = 0;
  let renders = 0;
  let lastMessageAt = 0;
  let dirty = false;

  /** The counter snapshot at least `span` seconds older than the newest one (or the oldest). */
  function baseline(span) {
    const newest = counterHist[counterHist.length - 1];
    for (let i = counterHist.length - 2; i >= 0; i--) {
      if (newest.t - counterHist[i].t >= span) return counterHist[i];
    }
    return counterHist.length > 1 ? counterHist[0] : null;
  }

  function rate(span, pick) {
    const newest = counterHist[counterHist.length - 1];
    const base = baseline(span);
    if (!base || newest.t <= base.t) return null;
    const d = pick(newest.c) - pick(base.c);
    return d >= 0 ? d / (newest.t - base.t) : null;
  }

  function pushHist(arr, v) { arr.push(isNum(v) ? v : null); }

  function trim(now) {
    let cut = 0;
    while (cut < hist.t.length && hist.t[cut] < now - MAX_WINDOW_S - 5) cut++;
    if (cut < 64) return; // trim in batches: splicing 15 arrays each frame is wasted work
    const walk = (o) => {
      for (const k in o) Array.isArray(o[k]) ? o[k].splice(0, cut) : walk(o[k]);
    };
    walk(hist);
  }

  /** One flat shape from either the gateway's nested `/admin/state` (`policy` = the policy
   * snapshot, `gateway` = counters, `scraper` = scrape stats) or a flat one (policy
   * snapshot keys at the top, `counters`, `scrape`). */
  function normalize(raw) {
    const p = obj(raw.policy);
    const nested = p && (obj(p.nodes) || obj(p.controller)) ? p : null;
    const base = nested || raw;
    let policy = nested ? first(nested, ["policy", "name"]) : raw.policy;
    if (obj(policy)) policy = first(policy, ["name", "policy"]);
    return {
      policy: typeof policy === "string" ? policy : null,
      time: num(raw.time) ?? num(base.time),
      nodes: obj(base.nodes) || {},
      controller: obj(base.controller) || {},
      queue: obj(base.queue) || {},
      in_flight_requests: base.in_flight_requests,
      released_tokens_per_s: base.released_tokens_per_s,
      counters: obj(raw.counters) || obj(raw.gateway) || {},
      scrape: obj(raw.scrape) || obj(raw.scraper) || {},
      cluster: obj(raw.cluster),
      refused_peak: obj(base.refused_peak),
      raw,
    };
  }

  /** One state (or history point) into the charts' history, at page time `now`; `live`:
   * a state pushed now (history points do not move the tables or the sparklines). */
  function ingest(raw, now = Date.now() / 1000, live = true) {
    const state = normalize(raw);
    const serverT = num(state.time);
    const t = serverT ?? now;
    if (serverT !== null) {
      // A history point this page has already charted (a reconnect's overlap) is skipped;
      // a live state never is (a restarted gateway's clock may start over).
      if (!live && lastServerT !== null && serverT <= lastServerT) return;
      lastServerT = serverT;
    }
    const c = readCounters(state);
    // A restarted gateway starts its counters (and clock) over: start the rates over too.
    const prev = counterHist[counterHist.length - 1];
    if (prev && (t < prev.t || sumLeaves(c.admitted) < sumLeaves(prev.c.admitted))) counterHist.length = 0;
    counterHist.push({ t, c });
    while (counterHist.length > 2 && t - counterHist[0].t > REASON_WINDOW_S + 2) counterHist.shift();

    hist.t.push(now);
    for (const p of PRIOS) {
      pushHist(hist.adm[p], rate(RATE_WINDOW_S, (x) => x.admitted[p]));
      pushHist(hist.rej[p], rate(RATE_WINDOW_S, (x) => x.rejected[p]));
    }
    const ctl = obj(state.controller) || {};
    const bands = obj(state.queue.bands) || {};
    let oldest = null;
    for (const p of PRIOS) {
      const band = obj(bands[p]) || {};
      pushHist(hist.queued[p], num(band.waiting));
      const age = num(band.oldest_s);
      if (age !== null && (oldest === null || age > oldest)) oldest = age;
    }
    pushHist(hist.oldest, oldest);
    pushHist(hist.used, num(ctl.in_flight_tokens));
    pushHist(hist.setpoint, num(ctl.panic_watermark));

    // Counted from rejections (no dedicated counter): same window as the rejected chart.
    const retryWindow = c.retryExact ? SLOW_WINDOW_S : RATE_WINDOW_S;
    const retryRate = c.retryCount === null ? null : rate(retryWindow, (x) => x.retryCount ?? 0);
    let retryMean = null;
    const base = baseline(SLOW_WINDOW_S);
    if (base && c.retryCount !== null && c.retrySum !== null) {
      const dn = c.retryCount - (base.c.retryCount ?? 0);
      const ds = c.retrySum - (base.c.retrySum ?? 0);
      if (dn > 0 && ds >= 0) retryMean = ds / dn;
    }
    pushHist(hist.retryRate, retryRate);
    pushHist(hist.retryMean, retryMean);
    pushHist(hist.cancelRate, rate(SLOW_WINDOW_S, (x) => x.cancels));

    ingestNodes(state, live);
    trim(now);
    if (!live) return;
    lastState = state;
    lastNow = now;
    lastMessageAt = performance.now();
    updates++;
  }

  /** The gateway's `history` event: its points, oldest first, before the live states. */
  function ingestHistory(raw) {
    const h = obj(raw);
    const serverNow = num(h?.now);
    if (!h || serverNow === null || !Array.isArray(h.points)) return;
    const pageNow = Date.now() / 1000;
    for (const p of h.points) {
      const at = num(obj(p)?.time);
      if (at !== null) { ingest(p, pageNow - (serverNow - at), false); historyPoints++; }
    }
  }

  function ingestNodes(state, live) {
    const nodes = obj(state.nodes) || {};
    let repSum = 0, repN = 0, repMax = null, predSum = 0, predN = 0, predMax = null;
    for (const id in nodes) {
      const n = obj(nodes[id]) || {};
      const rep = num(obj(n.sample)?.kv_usage);
      const pred = num(n.predicted_usage);
      const fresh = n.fresh !== false && n.state !== "stale";
      if (rep !== null && fresh) { repSum += rep; repN++; repMax = Math.max(repMax ?? 0, rep); }
      if (pred !== null) { predSum += pred; predN++; predMax = Math.max(predMax ?? 0, pred); }
      if (!live) continue; // the sparklines are the live states' (5 a second, ~25 s)
      let h = nodeHist.get(id);
      if (!h) { h = { rep: [], pred: [] }; nodeHist.set(id, h); }
      h.rep.push(fresh ? rep : null);
      h.pred.push(pred);
      if (h.rep.length > SPARK_POINTS) { h.rep.shift(); h.pred.shift(); }
    }
    if (live) for (const id of [...nodeHist.keys()]) if (!(id in nodes)) nodeHist.delete(id);
    pushHist(hist.kvRepMean, repN ? repSum / repN : null);
    pushHist(hist.kvRepMax, repMax);
    pushHist(hist.kvPredMean, predN ? predSum / predN : null);
    pushHist(hist.kvPredMax, predMax);
  }

  // ---------- charts ----------
  const charts = {};
  let windowS = 300;

  /** The newest value of a chart's series `i` (null when it has none). */
  function latest(u, i) {
    const data = u.data[i] || [];
    for (let k = data.length - 1; k >= 0; k--) if (isNum(data[k])) return data[k];
    return null;
  }

  /** The time axis: the data's span, or, before any, the window ending now (not 1970). */
  function timeRange(u, min, max) {
    if (u.data[0].length && isNum(min) && isNum(max)) return [min, max];
    const now = Date.now() / 1000;
    return [now - windowS, now];
  }

  function makeChart(key, series, opts = {}) {
    const el = $(key);
    const yScale = { auto: true };
    if (opts.yRange) yScale.range = opts.yRange;
    const fmt = opts.fmt || fmtNum;
    const u = new uPlot({
      width: Math.max(200, el.clientWidth),
      height: 190,
      cursor: { drag: { x: false, y: false }, points: { show: false } },
      legend: { live: true },
      scales: { x: { time: true, range: timeRange }, y: yScale },
      axes: [
        { stroke: AXIS, grid: { stroke: GRID, width: 1 }, ticks: { stroke: GRID, width: 1 } },
        { stroke: AXIS, grid: { stroke: GRID, width: 1 }, ticks: { stroke: GRID, width: 1 }, size: 52,
          values: (u, vals) => vals.map(opts.fmt || ((v) => fmtNum(v, Math.abs(v) >= 1e4 ? 0 : 1))) },
      ],
      series: [
        { value: (u, v) => (v == null ? "–" : new Date(v * 1000).toLocaleTimeString()) },
        ...series.map((s) => ({
          label: s.label, stroke: s.color, width: s.width || 1.5, dash: s.dash,
          fill: s.fill, spanGaps: false, points: { show: false },
          // Hovered: the value under the cursor; otherwise the newest one.
          value: (u, v, i, idx) => {
            const shown = idx == null ? latest(u, i) : v;
            return shown == null ? "–" : fmt(shown);
          },
        })),
      ],
    }, [[], ...series.map(() => [])], el);
    charts[key] = { u, el, pick: series.map((s) => s.data), points: 0, nonZero: 0 };
    new ResizeObserver(() => {
      const w = Math.max(200, el.clientWidth);
      if (w !== u.width) u.setSize({ width: w, height: 190 });
    }).observe(el);
  }

  const zeroTo = (floor) => (u, min, max) => [0, Math.max(floor, (max || 0) * 1.15)];

  function buildCharts() {
    const perPrio = (src, dash) => PRIOS.map((p) => ({ label: p, color: PRIO_COLOR[p], data: src[p], dash }));
    makeChart("c-admitted", perPrio(hist.adm), { yRange: zeroTo(1) });
    makeChart("c-rejected", perPrio(hist.rej), { yRange: zeroTo(1) });
    makeChart("c-queue", perPrio(hist.queued), { yRange: zeroTo(1) });
    makeChart("c-budget", [
      { label: "in-flight tokens", color: "#58a6ff", data: hist.used, fill: "rgba(88,166,255,.12)" },
      { label: "oldest wait s", color: "#d29922", data: hist.oldest, dash: [6, 4] },
    ], { yRange: zeroTo(1) });
    makeChart("c-kv", [
      { label: "reported mean", color: "#58a6ff", data: hist.kvRepMean },
      { label: "reported max", color: "#58a6ff", data: hist.kvRepMax, dash: [4, 3], width: 1 },
      { label: "predicted mean", color: "#f0883e", data: hist.kvPredMean },
      { label: "predicted max", color: "#f0883e", data: hist.kvPredMax, dash: [4, 3], width: 1 },
      { label: "panic watermark", color: "#d29922", data: hist.setpoint, dash: [2, 4], width: 1 },
    ], { yRange: () => [0, 1], fmt: fmtPct });
    makeChart("c-retry", [
      { label: "Retry-After /s", color: "#f85149", data: hist.retryRate },
      { label: "mean Retry-After (s)", color: "#d29922", data: hist.retryMean, dash: [4, 3] },
      { label: "cancellations /s", color: "#bc8cff", data: hist.cancelRate },
    ], { yRange: zeroTo(1) });
  }

  /** Index of the first time >= t (binary search: the history is sorted). */
  function lowerBound(arr, t) {
    let lo = 0, hi = arr.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (arr[mid] < t) lo = mid + 1; else hi = mid; }
    return lo;
  }

  function renderCharts() {
    if (!hist.t.length) return;
    const end = hist.t[hist.t.length - 1];
    const start = lowerBound(hist.t, end - windowS);
    const xs = hist.t.slice(start);
    for (const key in charts) {
      const ch = charts[key];
      const ys = ch.pick.map((a) => a.slice(start));
      ch.u.setData([xs, ...ys]);
      ch.points = xs.length;
      ch.nonZero = ys.reduce((n, a) => n + a.filter((v) => isNum(v) && v > 0).length, 0);
    }
  }

  // ---------- tiles ----------
  function last(arr) { return arr.length ? arr[arr.length - 1] : null; }

  function setTile(id, value, detail, level) {
    const v = $(id), d = $(id + "-d");
    if (v.textContent !== value) v.textContent = value;
    if (d && d.textContent !== detail) d.textContent = detail;
    const tile = v.parentElement;
    tile.classList.toggle("alert", level === "alert");
    tile.classList.toggle("warn", level === "warn");
  }

  function renderTiles(state) {
    const perPrio = (src) => PRIOS.map((p) => `${p[0].toUpperCase()} ${fmtNum(last(src[p]))}`).join(" · ");
    const sum = (src) => PRIOS.reduce((s, p) => s + (last(src[p]) ?? 0), 0);
    setTile("t-admitted", fmtNum(sum(hist.adm)), perPrio(hist.adm));
    const rej = sum(hist.rej);
    setTile("t-rejected", fmtNum(rej), perPrio(hist.rej), rej > 0 ? "warn" : null);
    const ctl = obj(state.controller) || {};
    const waiting = num(state.queue.waiting);
    const oldest = last(hist.oldest);
    setTile("t-queue", fmtNum(waiting),
      `${perPrio(hist.queued)} · oldest ${oldest === null ? "–" : `${fmtNum(oldest)} s`}`,
      oldest !== null && oldest > 10 ? "warn" : null);
    const used = num(ctl.in_flight_tokens);
    setTile("t-budget", fmtNum(used), `${fmtNum(num(state.queue.tokens))} waiting`);
    const rr = last(hist.retryRate), rm = last(hist.retryMean);
    const c0 = readCounters(state);
    const note = rm !== null ? `mean ${fmtNum(rm)} s` : c0.retryExact ? "" : "one per rejection";
    setTile("t-retry", fmtNum(rr), note, rr > 0 ? "warn" : null);
    const c = readCounters(state);
    setTile("t-cancel", fmtNum(last(hist.cancelRate)), `total ${fmtNum(c.cancels)}`);
    setTile("t-inflight", fmtNum(num(state.in_flight_requests)),
      `released ${fmtNum(num(state.released_tokens_per_s))} tok/s`);
  }

  // ---------- nodes ----------
  const rows = new Map(); // id -> {tr, cells, canvas, ...}
  let order = [];
  let lastSortAt = 0;
  let lastTableAt = 0;
  let tablePass = 0;
  const TABLE_PERIOD_MS = 400;
  // Rows far off screen update their numbers only every ~2 s; scrolled into view, they
  // catch up at once.
  const onScreen = "IntersectionObserver" in window ? new IntersectionObserver((entries) => {
    for (const e of entries) {
      const row = rows.get(e.target.dataset.node);
      if (!row) continue;
      row.visible = e.isIntersecting;
      if (row.visible) { row.behind = true; schedule(); }
    }
  }, { rootMargin: "300px 0px" }) : null;

  function nodeState(n) {
    const s = typeof n.state === "string" ? n.state.toLowerCase() : null;
    if (s && s in SEVERITY) return s;
    if (n.fresh === false) return "stale";
    return s || "unknown";
  }

  function makeRow(id) {
    const tr = document.createElement("tr");
    tr.className = "node";
    tr.dataset.node = id;
    const td = (cls) => { const c = document.createElement("td"); if (cls) c.className = cls; tr.appendChild(c); return c; };
    const cells = {
      id: td(), state: td(), age: td("num"), kv: td("kvcol"), rep: td("num"), pred: td("num"),
      ceiling: td("num"), prefix: td("num"), reserved: td("num"), inflight: td("num"), running: td("num"), waiting: td("num"),
      latency: td("num"), scrape: td("num"), spark: td(),
    };
    cells.id.textContent = id;
    const badge = document.createElement("span");
    cells.state.appendChild(badge);
    const bar = document.createElement("div");
    bar.className = "bar";
    const pred = document.createElement("div"); pred.className = "pred";
    const rep = document.createElement("div"); rep.className = "rep";
    const high = document.createElement("div"); high.className = "mark";
    const panic = document.createElement("div"); panic.className = "mark panic";
    bar.append(pred, rep, high, panic);
    cells.kv.appendChild(bar);
    const canvas = document.createElement("canvas");
    canvas.className = "spark"; canvas.width = 120; canvas.height = 20;
    cells.spark.appendChild(canvas);
    if (onScreen) onScreen.observe(tr);
    // `behind`: its numbers are out of date (it was off screen).
    return { tr, cells, badge, rep, pred, high, panic, canvas, ctx: null, sparkTurn: rows.size,
      visible: true, behind: true, last: {} };
  }

  /** Style writes only when the value changed: each write invalidates layout. */
  function setStyle(row, el, prop, value) {
    const key = `${el}.${prop}`;
    if (row.last[key] !== value) { row.last[key] = value; row[el].style[prop] = value; }
  }

  function setText(row, key, text) {
    if (row.last[key] !== text) { row.last[key] = text; row.cells[key].textContent = text; }
  }

  function scrapeInfo(state, id) {
    const me = selfMember(state);
    if (me && Array.isArray(me.scrapes) && !me.scrapes.includes(id)) {
      const owner = obj(state.cluster.shards)?.[id];
      return { text: "shared", title: `polled by replica ${owner ?? "?"}; samples from the store` };
    }
    const s = obj(obj(state.scrape)?.[id]) || obj(obj(obj(state.scrape)?.nodes)?.[id]);
    if (!s) return { text: "–", title: "" };
    const lat = num(first(s, ["latency_s", "last_latency_s", "scrape_latency_s"]));
    const fails = num(first(s, ["consecutive_failures", "failures", "failures_total"]));
    // A poll slower than the one before it is shown while it waits: a busy engine's page.
    const waiting = num(s.in_flight_s);
    let text = waiting !== null && waiting > Math.max(lat ?? 0, 0.25) ? `⏳${fmtMs(waiting)}`
      : lat !== null ? fmtMs(lat) : "–";
    if (fails) text += ` ✗${fmtNum(fails)}`;
    const period = num(s.period_s);
    const title = [typeof s.last_error === "string" ? s.last_error : "",
      period !== null ? `polled every ${fmtMs(period)}` : ""].filter(Boolean).join("; ");
    return { text, title };
  }

  function watermarks(state) {
    const ctl = obj(state.controller) || {};
    const pol = obj(state.raw.policy) || {};
    const cfg = obj(state.raw.config) || {};
    const pick = (k) => num(ctl[k]) ?? num(pol[k]) ?? num(cfg[k]) ?? num(obj(cfg.admission)?.[k]);
    return { high: pick("high_watermark"), panic: pick("panic_watermark") };
  }

  /** A node's state shows at once (every frame, and it rarely changes). */
  function renderNodeState(row, n) {
    const st = nodeState(n);
    if (row.last.st !== st) {
      row.last.st = st;
      row.tr.className = `node state-${st}`;
      row.badge.className = `badge b-${st}`;
      row.badge.textContent = st;
    }
  }

  /** A node's numbers, bars and sparkline (only for rows on or near the screen). */
  function renderNode(row, id, n, state, wm) {
    const sample = obj(n.sample);
    const rep = num(sample?.kv_usage), pred = num(n.predicted_usage);
    setText(row, "age", fmtAge(num(n.age_s)));
    setStyle(row, "rep", "width", rep === null ? "0" : `${Math.min(100, rep * 100).toFixed(1)}%`);
    setStyle(row, "pred", "width", pred === null ? "0" : `${Math.min(100, pred * 100).toFixed(1)}%`);
    setStyle(row, "high", "left", wm.high === null ? "-10px" : `${wm.high * 100}%`);
    setStyle(row, "panic", "left", wm.panic === null ? "-10px" : `${wm.panic * 100}%`);
    setText(row, "rep", fmtPct(rep));
    setText(row, "pred", fmtPct(pred));
    // The ceiling the engine's measurement sets (kvgate.core.plan.ceiling), and why.
    setText(row, "ceiling", fmtPct(num(n.ceiling)));
    const why = n.ceiling_reason ? `${n.ceiling_reason}: ${n.ceiling_detail ?? ""}` : "";
    if (row.cells.ceiling.title !== why) row.cells.ceiling.title = why;
    // Prefix cache hits (kvgate.core.policies.routing): the engine's own rate, then what
    // kvgate's index predicted for what it sent there; the index's size on hover.
    const seen = num(n.prefix_hit_rate_seen), predicted = num(n.prefix_hit_rate_predicted);
    setText(row, "prefix", seen === null && predicted === null ? "–"
      : `${fmtPct(seen)} / ${fmtPct(predicted)}`);
    const blocks = num(n.prefix_index_blocks), resyncs = num(n.prefix_resyncs);
    const indexed = blocks === null ? "" : `index: ${fmtNum(blocks)} blocks` +
      (resyncs ? `, ${fmtNum(resyncs)} resyncs` : "");
    if (row.cells.prefix.title !== indexed) row.cells.prefix.title = indexed;
    setText(row, "reserved", fmtNum(num(n.reserved_tokens)));
    setText(row, "inflight", fmtNum(num(n.in_flight)));
    setText(row, "running", fmtNum(num(sample?.running)));
    setText(row, "waiting", fmtNum(num(sample?.waiting)));
    setText(row, "latency", fmtMs(num(sample?.iteration_latency_s)));
    const scrape = scrapeInfo(state, id);
    setText(row, "scrape", scrape.text);
    if (row.cells.scrape.title !== scrape.title) row.cells.scrape.title = scrape.title;
    // Sparklines span ~25 s: redrawing each every other table refresh (~1 s) looks the
    // same and costs half.
    if (row.sparkTurn++ % 2 === 0) drawSpark(row, nodeHist.get(id));
  }

  function drawSpark(row, h) {
    const ctx = row.ctx || (row.ctx = row.canvas.getContext("2d"));
    const w = row.canvas.width, ht = row.canvas.height;
    ctx.clearRect(0, 0, w, ht);
    if (!h) return;
    const line = (arr, color) => {
      ctx.strokeStyle = color; ctx.lineWidth = 1.2; ctx.beginPath();
      let pen = false;
      const off = SPARK_POINTS - arr.length;
      for (let i = 0; i < arr.length; i++) {
        const v = arr[i];
        if (!isNum(v)) { pen = false; continue; }
        const x = ((off + i) / (SPARK_POINTS - 1)) * (w - 1);
        const y = ht - 1 - Math.min(1, Math.max(0, v)) * (ht - 2);
        if (pen) ctx.lineTo(x, y); else { ctx.moveTo(x, y); pen = true; }
      }
      ctx.stroke();
    };
    line(h.pred, "#f0883e");
    line(h.rep, "#58a6ff");
  }

  function sortKey(mode, nodes) {
    const ids = Object.keys(nodes);
    const natural = (a, b) => a.localeCompare(b, undefined, { numeric: true });
    if (mode === "name") return ids.sort(natural);
    if (mode === "predicted") {
      return ids.sort((a, b) => (num(nodes[b].predicted_usage) ?? -1) - (num(nodes[a].predicted_usage) ?? -1) || natural(a, b));
    }
    // Within a state, fuller first, in 10% steps: finer would reshuffle rows (and relayout
    // the whole table) every second as usage wobbles by a point or two.
    const step = (id) => Math.floor((num(nodes[id].predicted_usage) ?? -0.1) * 10);
    return ids.sort((a, b) => SEVERITY[nodeState(nodes[a])] - SEVERITY[nodeState(nodes[b])] ||
      step(b) - step(a) || natural(a, b));
  }

  function renderNodes(state, force) {
    const nodes = obj(state.nodes) || {};
    const tbody = $("node-rows");
    for (const [id, row] of rows) if (!(id in nodes)) { row.tr.remove(); rows.delete(id); }
    const wm = watermarks(state);
    const counts = {};
    const now = performance.now();
    // Numbers in a 64-row table changing 5 times a second are unreadable, and the table's
    // layout is most of the page's cost: refresh it at 2.5 Hz, states and charts at 5 Hz.
    const numbers = force || now - lastTableAt >= TABLE_PERIOD_MS;
    if (numbers) { lastTableAt = now; tablePass++; }
    const offScreenToo = numbers && tablePass % 5 === 0; // off-screen rows every ~2 s
    for (const id in nodes) {
      let row = rows.get(id);
      if (!row) { row = makeRow(id); rows.set(id, row); tbody.appendChild(row.tr); force = true; }
      const n = obj(nodes[id]) || {};
      renderNodeState(row, n);
      if ((numbers && row.visible) || offScreenToo || row.behind) {
        row.behind = false;
        renderNode(row, id, n, state, wm);
      }
      const st = nodeState(n);
      counts[st] = (counts[st] || 0) + 1;
    }
    // Re-sort at most once a second, so rows don't jump under the operator's eyes.
    if (force || now - lastSortAt > 1000) {
      lastSortAt = now;
      const next = sortKey($("sort").value, Object.fromEntries(Object.entries(nodes).map(([k, v]) => [k, obj(v) || {}])));
      if (next.join("\u0000") !== order.join("\u0000")) {
        order = next;
        const frag = document.createDocumentFragment();
        for (const id of order) frag.appendChild(rows.get(id).tr);
        tbody.appendChild(frag);
      }
    }
    const total = Object.keys(nodes).length;
    if ($("no-nodes").hidden !== total > 0) $("no-nodes").hidden = total > 0;
    if ($("node-count").textContent !== `(${total})`) $("node-count").textContent = `(${total})`;
    const summary = Object.keys(SEVERITY).filter((s) => counts[s])
      .map((s) => `<span class="badge b-${s}">${counts[s]} ${s}</span>`).join("");
    if ($("node-summary").innerHTML !== summary) $("node-summary").innerHTML = summary;
  }

  function renderReasons() {
    const el = $("reasons");
    if (counterHist.length < 2) return;
    const newest = counterHist[counterHist.length - 1];
    const base = baseline(REASON_WINDOW_S);
    const parts = [];
    for (const r in newest.c.reasons) {
      const d = newest.c.reasons[r] - (base.c.reasons[r] || 0);
      if (d > 0) parts.push([r, d]);
    }
    parts.sort((a, b) => b[1] - a[1]);
    const text = parts.length ? parts.map(([r, d]) => `<span>${escapeHtml(r)} <b>${fmtNum(d)}</b></span>`).join("") : "none";
    if (el.innerHTML !== text) el.innerHTML = text;
  }

  /** The planned peak of the last refusal by the plan (`refused_peak`): which node came
   * closest, what the plan foresaw there with the request, and what its engine reported. */
  function renderRefusedPeak(state) {
    const el = $("refused-peak");
    const r = state.refused_peak;
    const peak = r ? num(r.planned_peak) : null;
    if (el.hidden !== (peak === null)) el.hidden = peak === null;
    if (peak === null) return;
    const pct = (v) => (num(v) === null ? "–" : `${Math.round(num(v) * 100)}%`);
    const usage = num(r.kv_usage) === null ? "" : `; its engine reported ${pct(r.kv_usage)}`;
    const text = `Last refused by the plan (${r.priority ?? "?"}, ${fmtNum(num(r.age_s))} s ago):` +
      ` on ${r.node ?? "?"} the KV peak planned with it was ${pct(peak)} of the cache,` +
      ` over its ${pct(r.ceiling)} ceiling${usage}.`;
    if (el.textContent !== text) el.textContent = text;
  }

  // ---------- replicas ----------
  function selfMember(state) {
    const members = state.cluster && Array.isArray(state.cluster.members) ? state.cluster.members : [];
    return members.find((m) => obj(m) && m.self) || null;
  }

  function renderReplicas(state) {
    const c = state.cluster;
    const section = $("replicas");
    if (section.hidden !== !c) section.hidden = !c;
    if (!c) return;
    const sync = obj(c.sync) || {};
    const lat = num(sync.last_latency_ms);
    const summary = `(${fmtNum(num(c.replicas))}) · store ${c.store ?? "?"} ` +
      `${String(c.state ?? "?").toUpperCase()}${lat !== null ? ` · sync ${fmtNum(lat, 2)} ms` : ""}` +
      (sync.last_error ? ` · last error: ${sync.last_error}` : "");
    if ($("replica-summary").textContent !== summary) $("replica-summary").textContent = summary;
    section.classList.toggle("alert", c.state === "isolated");
    const rowsHtml = (Array.isArray(c.members) ? c.members : []).map((m) => {
      const cell = (v, cls) => `<td${cls ? ` class="${cls}"` : ""}>${escapeHtml(v ?? "")}</td>`;
      const count = (a) => (Array.isArray(a) ? a.length : "–");
      return `<tr>${cell(m.id + (m.self ? " (this one)" : ""))}${cell(m.host)}${cell(m.pid, "num")}` +
        `${cell(m.state)}${cell(count(m.owns), "num")}${cell(count(m.scrapes), "num")}</tr>`;
    }).join("");
    if ($("replica-rows").innerHTML !== rowsHtml) $("replica-rows").innerHTML = rowsHtml;
  }

  // ---------- tenants ----------
  let tenantHtml = "";

  /** The gateway's `tenants` table: the columns it lists ([key, heading], in order), one
   * row per tenant; a new figure needs no change here. */
  function renderTenants(state) {
    const t = obj(state.raw.tenants);
    const columns = Array.isArray(t?.columns)
      ? t.columns.filter((c) => Array.isArray(c) && c.length === 2) : [];
    const rows = Array.isArray(t?.rows) ? t.rows.filter((r) => obj(r)) : [];
    const section = $("tenants");
    const show = columns.length > 0 && rows.length > 0;
    if (section.hidden !== !show) section.hidden = !show;
    if (!show) return;
    const head = "<th>tenant</th>" +
      columns.map(([, heading]) => `<th class="num">${escapeHtml(heading)}</th>`).join("");
    const body = rows.map((r) => `<tr><td>${escapeHtml(r.tenant || NO_KEY)}</td>` +
      columns.map(([key]) => `<td class="num">${fmtNum(num(r[key]))}</td>`).join("") + "</tr>").join("");
    if (head + body === tenantHtml) return;
    tenantHtml = head + body;
    $("tenant-head").innerHTML = head;
    $("tenant-rows").innerHTML = body;
    $("tenant-count").textContent = `(${rows.length})`;
  }

  function escapeHtml(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }

  // ---------- main loop ----------
  const renderMs = []; // the last 600 frame costs, for the benchmark and for curious operators

  function render() {
    dirty = false;
    if (!lastState) return;
    const t0 = performance.now();
    $("policy").textContent = lastState.policy || "–";
    renderTiles(lastState);
    renderCharts();
    renderNodes(lastState, false);
    renderReplicas(lastState);
    renderTenants(lastState);
    renderReasons();
    renderRefusedPeak(lastState);
    renders++;
    renderMs.push(performance.now() - t0);
    if (renderMs.length > 600) renderMs.shift();
  }

  function schedule() {
    if (dirty) return;
    dirty = true;
    requestAnimationFrame(render);
  }

  function setConn(cls, text) {
    const el = $("conn");
    el.className = `conn ${cls}`;
    el.textContent = text;
  }

  function connect() {
    // Credentials: with server.admin_token set, the browser asks once (HTTP Basic) and
    // sends them again with this same-origin stream; no token ever goes into a URL.
    const params = new URLSearchParams(location.search);
    const q = new URLSearchParams();
    if (params.get("interval_ms")) q.set("interval_ms", params.get("interval_ms"));
    const url = "/admin/events" + (q.toString() ? `?${q}` : "");
    const es = new EventSource(url);
    es.onopen = () => setConn("conn-live", "live");
    es.onmessage = (ev) => {
      let state;
      try { state = JSON.parse(ev.data); } catch { return; }
      if (!obj(state)) return;
      ingest(state);
      schedule();
    };
    es.addEventListener("history", (ev) => {
      let history;
      try { history = JSON.parse(ev.data); } catch { return; }
      ingestHistory(history);
      schedule();
    });
    es.addEventListener("error", (ev) => {
      if (ev.data) setConn("conn-down", "gateway error");
      else setConn(es.readyState === EventSource.CLOSED ? "conn-down" : "conn-wait", "reconnecting…");
    });
    // A stream that stays open but goes silent is as bad as a closed one: say so.
    setInterval(() => {
      if (!lastMessageAt) return;
      const silent = (performance.now() - lastMessageAt) / 1000;
      if (silent > 2) setConn("conn-down", `no data for ${silent.toFixed(0)} s`);
      else if (es.readyState === EventSource.OPEN) setConn("conn-live", "live");
    }, 1000);
    return es;
  }

  function start() {
    windowS = Number($("window").value) || 300;
    $("window").addEventListener("change", (e) => { windowS = Number(e.target.value) || 300; schedule(); });
    $("sort").addEventListener("change", () => { if (lastState) renderNodes(lastState, true); });
    buildCharts();
    const es = connect();
    // A read-only handle for tests and for operators poking at the console.
    window.kvgate = {
      get updates() { return updates; },
      get renders() { return renders; },
      get state() { return lastState; },
      get lastUpdate() { return lastNow; },
      get historyPoints() { return historyPoints; },
      charts,
      hist,
      renderMs,
      // Nodes that take no work for want of signals (stale, or dead: scrapes failing hard).
      staleNodes: () => [...document.querySelectorAll("tr.node.state-stale, tr.node.state-dead")]
        .map((tr) => tr.dataset.node),
      events: es,
    };
  }

  start();
})();
