// stepscope's live charts: batches of new steps (app/live/encode.py) appended in the browser and
// drawn with plotly.js in place, so zoom, pan and hover survive every update.
//
// The page pulls: after drawing a batch, the view reports the batch's id through the
// component's state (`pull`), which reruns the charts' fragment on the server, whose answer is
// the next batch. A batch that does not extend what the view holds (`base` differs) is ignored
// and the view asks again from where it is. Everything the charts show was decided in Python;
// this file only keeps the columns (the last `window` steps) and lays them out, choosing per-step
// totals over per-request segments when the steps in view would be thinner than a few pixels.
(function () {
  "use strict";
  const STEP_COLS = ["step", "t0", "t1", "phase", "budget", "used", "cached", "free", "total",
    "reserved", "waiting", "running", "prompt", "decode", "wasted", "stalled", "sampled"];
  const ITEM_COLS = ["step", "uid", "kind", "a", "b", "base", "w"];
  const KINDS = ["chunk", "prefill", "decode"];
  const REQ_FIELDS = ["uid", "state", "t_queued", "t_first_token", "t_finished"];
  const REF_KEEP = 16; // decode stacks kept at batch ends, for batches that overlap what we hold
  const HALF = 0.45; // a step's bar half-width in step units
  const views = new Map(); // parentElement -> LiveView

  // ---- the data the browser holds ------------------------------------------------------------
  class Columns {
    constructor(names) { this.names = names; this.clear(); }
    clear() { for (const n of this.names) this[n] = []; this.length = 0; }
    push(cols, n) {
      for (const name of this.names) {
        const src = cols[name];
        const dst = this[name];
        for (let i = 0; i < n; i++) dst.push(src ? src[i] : 0);
      }
      this.length += n;
    }
    dropFront(n) {
      if (n <= 0) return;
      for (const name of this.names) this[name].splice(0, n);
      this.length -= n;
    }
  }

  function lowerBound(arr, x) { // first index with arr[i] >= x
    let lo = 0, hi = arr.length;
    while (lo < hi) { const m = (lo + hi) >> 1; if (arr[m] < x) lo = m + 1; else hi = m; }
    return lo;
  }

  // A batch's packed items (app/live/encode.py, `unpack` there defines the format) as columns:
  // each step says how its decode stack differs from the one before (`dd` left, `da` joined at
  // a position, `dw` wasted, `n` no decodes) and lists its prompt pieces (`p`).
  function unpackItems(packed, ref) {
    const cols = { i: [], uid: [], kind: [], a: [], b: [], base: [], w: [] };
    let stack = new Map(ref);
    packed.forEach((pk, i) => {
      const rows = [];
      if (!pk.n && (stack.size || pk.da)) {
        for (const u of pk.dd || []) stack.delete(u);
        const da = pk.da || [];
        for (let k = 0; k < da.length; k += 2) stack.set(da[k], da[k + 1]);
        const waste = new Set(pk.dw || []);
        const next = new Map();
        for (const [u, a] of stack) { rows.push([u, 2, a, a + 1, waste.has(u) ? 1 : 0]); next.set(u, a + 1); }
        stack = next;
      }
      const p = pk.p || [], others = [];
      for (let k = 0; k < p.length; k += 5) others.push(p.slice(k, k + 5));
      const ordered = rows.filter((r) => !r[4]).concat(others.filter((r) => !r[4]),
        rows.filter((r) => r[4]), others.filter((r) => r[4]));
      let base = 0;
      for (const [uid, kind, a, b, w] of ordered) {
        cols.i.push(i); cols.uid.push(uid); cols.kind.push(kind); cols.a.push(a); cols.b.push(b);
        cols.base.push(base); cols.w.push(w);
        base += b - a;
      }
    });
    return { cols, ref: stack };
  }

  // a column holding one value throughout a batch comes as that value (encode.compact_columns)
  function expandColumns(cols) {
    let n = 0;
    for (const c of Object.values(cols)) if (Array.isArray(c)) n = Math.max(n, c.length);
    const out = {};
    for (const [k, c] of Object.entries(cols)) out[k] = Array.isArray(c) ? c : new Array(n).fill(c);
    return out;
  }

  class Record {
    constructor() {
      this.ref = new Map(); // the decode stack after the last step held
      this.refAt = new Map(); // step number -> the decode stack after it (recent batch ends)
      this.steps = new Columns(STEP_COLS);
      this.items = new Columns(ITEM_COLS);
      this.requests = new Map();
      this.stalls = []; // [uid, firstStep, lastStep, seconds] closed stalls
      this.ongoing = [];
      this.runs = new Map(); // uid -> [[firstStep, lastStep], ...] steps that gave it a token
      this.chunks = []; // [step, uid, a, b, kind] prompt pieces
      this.firstItemStep = new Map(); // uid -> first step it appeared in
    }
    // the decode stack a batch starting at step `first` unpacks from, if we know it
    refBefore(first) {
      const held = this.steps.length ? this.steps.step[this.steps.length - 1] : null;
      if (held === null || first === held + 1) return this.ref;
      return this.refAt.get(first - 1) || null;
    }
    apply(batch, windowSteps) {
      const s = expandColumns(batch.steps);
      const held = this.steps.length ? this.steps.step[this.steps.length - 1] : -Infinity;
      const start = s.step.length ? this.refBefore(s.step[0]) : this.ref;
      if (!start) return false; // it extends a step whose stack we no longer have: ask again
      const un = unpackItems(batch.packed || [], start);
      const it = un.cols;
      if (s.step.length && s.step[s.step.length - 1] > held) {
        this.ref = un.ref;
        this.refAt.set(s.step[s.step.length - 1], un.ref);
        while (this.refAt.size > REF_KEEP) this.refAt.delete(this.refAt.keys().next().value);
      }
      let k0 = 0; // the first new step of the batch
      while (k0 < s.step.length && s.step[k0] <= held) k0++;
      const n = s.step.length - k0;
      const fresh = {};
      for (const name of STEP_COLS) fresh[name] = (s[name] || []).slice(k0);
      this.steps.push(fresh, n);
      let j0 = 0;
      while (j0 < it.i.length && it.i[j0] < k0) j0++;
      const m = it.i.length - j0;
      const stepOf = it.i.slice(j0).map((i) => s.step[i]);
      const cols = { step: stepOf };
      for (const name of ITEM_COLS) if (name !== "step") cols[name] = it[name].slice(j0);
      this.items.push(cols, m);
      for (let jj = 0; jj < m; jj++) {
        const j = jj + j0;
        const uid = it.uid[j], step = stepOf[jj], kind = it.kind[j];
        if (!this.firstItemStep.has(uid)) this.firstItemStep.set(uid, step);
        if (it.w[j]) continue;
        if (kind !== 2) this.chunks.push([step, uid, it.a[j], it.b[j], kind]);
        if (kind === 2) {
          let r = this.runs.get(uid);
          if (!r) { r = []; this.runs.set(uid, r); }
          const last = r[r.length - 1];
          if (last && last[1] === step - 1) last[1] = step; else r.push([step, step]);
        }
      }
      const known = new Set(this.stalls.map((x) => x[0] + ":" + x[1]));
      for (const st of batch.stalls || []) if (!known.has(st[0] + ":" + st[1])) this.stalls.push(st);
      if (batch.ongoing) this.ongoing = batch.ongoing;
      for (const row of batch.requests || []) {
        const rec = {};
        REQ_FIELDS.forEach((f, k) => { rec[f] = row[k]; });
        this.requests.set(rec.uid, rec);
      }
      this.trim(windowSteps);
      return true;
    }
    trim(windowSteps) {
      const extra = this.steps.length - windowSteps;
      if (extra <= 0) return;
      this.steps.dropFront(extra);
      const first = this.steps.step[0];
      this.items.dropFront(lowerBound(this.items.step, first));
      this.stalls = this.stalls.filter((x) => x[2] >= first);
      this.chunks = this.chunks.filter((c) => c[0] >= first);
      for (const [uid, r] of this.runs) {
        while (r.length && r[0][1] < first) r.shift();
        if (!r.length) this.runs.delete(uid);
      }
      for (const [uid, step] of this.firstItemStep) if (step < first && !this.runs.has(uid)
        && !this.chunks.some((c) => c[1] === uid)) this.firstItemStep.delete(uid);
      const t0 = this.steps.t0[0];
      for (const [uid, r] of this.requests) {
        const ended = r.state !== "waiting" && r.state !== "running";
        if (ended && r.t_finished !== null && r.t_finished < t0) this.requests.delete(uid);
      }
    }
  }

  // ---- the x axis: steps or engine time -----------------------------------------------------
  class Axis {
    constructor(rec, mode) { this.rec = rec; this.mode = mode; }
    index(step) { return lowerBound(this.rec.steps.step, step); }
    lo(i) { const s = this.rec.steps; return this.mode === "time" ? s.t0[i] : s.step[i] - HALF; }
    hi(i) { const s = this.rec.steps; return this.mode === "time" ? s.t1[i] : s.step[i] + HALF; }
    mid(i) { return (this.lo(i) + this.hi(i)) / 2; }
    atTime(t) { // where something that happened at engine time t can first show up
      const s = this.rec.steps;
      if (this.mode === "time") return t;
      const i = lowerBound(s.t0, t);
      return i < s.length ? this.lo(i) : this.hi(s.length - 1);
    }
    // the step indices [i0, i1) whose bars fall inside x range [x0, x1]
    window(range) {
      const n = this.rec.steps.length;
      if (!range) return [0, n];
      let i0 = 0, i1 = n;
      while (i0 < n && this.hi(i0) < range[0]) i0++;
      while (i1 > i0 && this.lo(i1 - 1) > range[1]) i1--;
      return [i0, i1];
    }
  }

  // ---- the timeline: batch composition on top, one lane per request below -------------------
  function color(style, uid) { return style.palette[uid % style.palette.length]; }

  // Level of detail for per-step lines and areas: at most one group per two pixels. Steps are
  // grouped by step number (k to a group, k = steps in view per 2 px), so a group keeps its
  // members as new steps arrive and the drawing does not shimmer between updates. Each group is
  // drawn as its peak step (`key` picks it), over the group's whole width.
  function stepsPerPixel(nView, widthPx) { return Math.max(1, Math.ceil((2 * nView) / Math.max(widthPx, 100))); }

  function groups(rec, k, key) {
    const s = rec.steps, out = []; // [first index, last index, peak index]
    for (let a = 0; a < s.length;) {
      const g = Math.floor(s.step[a] / k);
      let b = a, peak = a, best = key(a);
      while (b + 1 < s.length && Math.floor(s.step[b + 1] / k) === g) {
        b++;
        const v = key(b);
        if (v > best) { best = v; peak = b; }
      }
      out.push([a, b, peak]);
      a = b + 1;
    }
    return out;
  }

  function timelineFigure(rec, axis, style, range, widthPx) {
    const s = rec.steps;
    const [i0, i1] = axis.window(range);
    const nView = i1 - i0;
    const it = rec.items;
    const j0 = nView ? lowerBound(it.step, s.step[i0]) : 0;
    const j1 = nView ? lowerBound(it.step, s.step[i1 - 1] + 1) : 0;
    const detail = nView * style.lod.px_per_step <= widthPx && j1 - j0 <= style.lod.max_segments;
    let top = 1, budgetMax = 0;
    for (let i = i0; i < i1; i++) {
      top = Math.max(top, s.prompt[i] + s.decode[i] + s.wasted[i]);
      budgetMax = Math.max(budgetMax, s.budget[i]);
    }
    const budgetVisible = budgetMax <= 4 * top;
    const yTop = 1.12 * (budgetVisible ? Math.max(top, budgetMax) : top);
    const data = [];
    // phase band: one background rectangle per run of same-phase steps, below the bars (layout
    // shapes; a scatter fill would cover the bars). Many short runs: one heatmap row instead.
    const runs = [];
    for (let a = 0; a < s.length;) {
      let b = a;
      while (b + 1 < s.length && s.phase[b + 1] === s.phase[a]) b++;
      const x0 = axis.mode === "time" ? s.t0[a] : s.step[a] - 0.5;
      const x1 = axis.mode === "time" ? s.t1[b] : s.step[b] + 0.5;
      runs.push([x0, x1, style.phase_colors[style.phases[s.phase[a]]] || "#eee"]);
      a = b + 1;
    }
    const shapes = [];
    if (runs.length <= 300) {
      for (const [x0, x1, fill] of runs) {
        shapes.push({ type: "rect", layer: "below", xref: "x", yref: "y", x0, x1, y0: 0,
          y1: yTop, fillcolor: fill, line: { width: 0 } });
      }
    } else {
      const ex = runs.map((r) => r[0]);
      ex.push(runs[runs.length - 1][1]);
      const z = runs.map((r) => style.phases.findIndex((p) => style.phase_colors[p] === r[2]));
      const scale = [];
      style.phases.forEach((p, k) => {
        scale.push([k / 3, style.phase_colors[p]], [(k + 1) / 3, style.phase_colors[p]]);
      });
      data.push({ type: "heatmap", x: ex, y: [0, yTop], z: [z], zmin: -0.5, zmax: 2.5,
        colorscale: scale, showscale: false, hoverinfo: "skip", name: "phase" });
    }
    const k = detail ? 1 : stepsPerPixel(nView, widthPx);
    if (detail) data.push(...segmentTraces(rec, axis, style, j0, j1));
    else data.push(...totalTraces(rec, axis, style, k));
    // the budget changes rarely: one point per change, drawn as steps ("hv")
    const bx = [], by = [];
    for (let i = 0; i < s.length; i++) {
      if (i === 0 || s.budget[i] !== s.budget[i - 1]) { bx.push(axis.lo(i)); by.push(s.budget[i]); }
    }
    if (s.length) { bx.push(axis.hi(s.length - 1)); by.push(s.budget[s.length - 1]); }
    data.push({ type: "scatter", x: bx, y: by, mode: "lines", name: "budget (max_extend_tokens)",
      line: { color: "#222", width: 2, dash: "dash", shape: "hv" }, hovertemplate: "budget %{y}<extra></extra>",
      visible: budgetVisible });
    const sx = [], sy = [], sc = [];
    for (const [a, b, peak] of groups(rec, k, (i) => s.stalled[i])) {
      if (s.stalled[peak]) { sx.push((axis.lo(a) + axis.hi(b)) / 2); sy.push(-0.05 * yTop); sc.push(s.stalled[peak]); }
    }
    data.push({ type: "scatter", x: sx, y: sy, mode: "markers", name: "decode stalled",
      marker: { color: style.stall, symbol: "triangle-up", size: 7 }, customdata: sc,
      hovertemplate: "%{customdata} decoding request(s) got no token<extra></extra>" });
    const lanes = laneTraces(rec, axis, style, detail);
    data.push(...lanes.data);
    const lanePx = 26 * Math.max(lanes.labels.length, 3);
    const batchPx = 300;
    const split = lanePx / (lanePx + batchPx);
    const annotations = budgetVisible ? [] : [{ text: `budget ${budgetMax} ↑ (above the chart)`,
      xref: "paper", yref: "y domain", x: 1, y: 1, xanchor: "right", yanchor: "top", showarrow: false }];
    const layout = {
      height: batchPx + lanePx + 130, barmode: "overlay", uirevision: "timeline",
      margin: { l: 60, r: 20, t: 12, b: 40 }, hovermode: "closest",
      showlegend: false, // the legend is HTML above the plot: Plotly would re-measure it every update
      xaxis: { title: { text: style.x_titles[axis.mode] }, anchor: "y2", autorange: true },
      yaxis: { title: { text: "tokens in step" }, range: [-0.09 * yTop, yTop], domain: [split + 0.06, 1] },
      yaxis2: { title: { text: "request" }, type: "category", categoryorder: "array",
        categoryarray: lanes.labels.slice().reverse(), domain: [0, split], anchor: "x" },
      uniformtext: { minsize: 9, mode: "hide" }, annotations, shapes,
    };
    return { data, layout, detail, nView };
  }

  function segmentTraces(rec, axis, style, j0, j1) {
    const it = rec.items;
    const parts = { prompt: newBars(), decode: newBars(), wasted: newBars() };
    let i = axis.index(it.step[j0]);
    for (let j = j0; j < j1; j++) {
      while (rec.steps.step[i] < it.step[j]) i++;
      const key = it.w[j] ? "wasted" : it.kind[j] === 2 ? "decode" : "prompt";
      const p = parts[key], n = it.b[j] - it.a[j], uid = it.uid[j];
      p.x.push(axis.mid(i)); p.y.push(n); p.base.push(it.base[j]);
      p.width.push(0.9 * (axis.hi(i) - axis.lo(i)));
      p.color.push(key === "wasted" ? style.wasted : color(style, uid));
      p.cd.push([uid, KINDS[it.kind[j]], it.a[j], it.b[j], it.step[j]]);
      if (key === "prompt") p.text.push(`req ${uid} [${it.a[j]}:${it.b[j]})`);
    }
    const bar = (p, name, pattern, extra) => Object.assign({ type: "bar", name, x: p.x, y: p.y,
      base: p.base, width: p.width, customdata: p.cd,
      marker: { color: p.color, pattern: Object.assign({ fgcolor: "white", fgopacity: 0.8, size: 6 }, pattern), line: { width: 0 } },
      hovertemplate: "step %{customdata[4]} · req %{customdata[0]} · %{customdata[1]} [%{customdata[2]}:%{customdata[3]})<extra></extra>",
    }, extra);
    return [
      bar(parts.prompt, "prompt chunk (hatched)", { shape: "/", fillmode: "overlay" }, {
        text: parts.prompt.text, textposition: "inside", textangle: -90, insidetextanchor: "middle",
        textfont: { color: "white", size: 11 } }),
      bar(parts.decode, "decode token (solid)", { shape: "" }, { textposition: "none" }),
      bar(parts.wasted, "wasted (request ended mid-step)", { shape: "x", fillmode: "overlay" },
        { textposition: "none", hovertemplate: "step %{customdata[4]} · req %{customdata[0]} ended while this step ran: %{customdata[1]} [%{customdata[2]}:%{customdata[3]}) wasted<extra></extra>" }),
    ];
  }

  function newBars() { return { x: [], y: [], base: [], width: [], color: [], cd: [], text: [] }; }

  function totalTraces(rec, axis, style, k) {
    const s = rec.steps;
    const x = [], dec = [], pro = [], was = [];
    for (const [a, b, i] of groups(rec, k, (j) => s.prompt[j] + s.decode[j] + s.wasted[j])) {
      x.push(axis.lo(a), axis.hi(b));
      dec.push(s.decode[i], s.decode[i]); pro.push(s.prompt[i], s.prompt[i]); was.push(s.wasted[i], s.wasted[i]);
    }
    const area = (name, y, col, pattern) => ({ type: "scatter", x, y, name, mode: "lines",
      stackgroup: "totals", line: { width: 0, color: col }, fillcolor: col,
      fillpattern: pattern, hovertemplate: `%{y} ${name.split(" (")[0]}<extra></extra>` });
    return [
      area("decode tokens (all requests)", dec, "#555", undefined),
      area("prompt tokens (all requests, hatched)", pro, "#999", { shape: "/", fgcolor: "white" }),
      area("wasted (request ended mid-step)", was, style.wasted, { shape: "x", fgcolor: "white" }),
    ];
  }

  function laneTraces(rec, axis, style, labels) {
    const s = rec.steps;
    if (!s.length) return { data: [], labels: [] };
    const firstStep = s.step[0], endX = axis.hi(s.length - 1), startX = axis.lo(0);
    const uids = [...rec.firstItemStep.keys()];
    for (const [uid, r] of rec.requests) if (r.state === "waiting" && !rec.firstItemStep.has(uid)) uids.push(uid);
    const shown = uids.slice(-style.max_lanes);
    const label = (u) => `req ${u}`;
    const segs = { waiting: lane(), chunk: lane(), decode: lane(), stall: lane() };
    const add = (kind, uid, x0, x1, text, hover) => {
      const g = segs[kind];
      g.y.push(label(uid)); g.base.push(x0); g.x.push(Math.max(x1 - x0, 0));
      g.color.push(kind === "stall" ? style.stall : color(style, uid)); g.text.push(text); g.hover.push(hover);
    };
    const set = new Set(shown);
    for (const uid of shown) {
      const r = rec.requests.get(uid);
      const first = rec.firstItemStep.get(uid);
      // waiting: from its arrival to its first step in view; not for a request that was
      // already running before the steps held here (cleared or scrolled out of the window)
      const before = r && r.t_first_token !== null && r.t_first_token !== undefined && r.t_first_token < s.t0[0];
      if (r && r.t_queued !== null && r.t_queued !== undefined && !before) {
        const x0 = Math.max(axis.atTime(r.t_queued), startX);
        const x1 = first === undefined ? endX : axis.lo(axis.index(first));
        if (x1 > x0) add("waiting", uid, x0, x1, "", "waiting");
      }
      for (const [a, b] of rec.runs.get(uid) || []) {
        const ia = axis.index(Math.max(a, firstStep)), ib = axis.index(b);
        add("decode", uid, axis.lo(ia), axis.hi(ib), "", `decode steps ${s.step[ia]}–${b} · ${b - s.step[ia] + 1} tokens`);
      }
    }
    for (const [step, uid, a, b, kind] of rec.chunks) {
      if (!set.has(uid)) continue;
      const i = axis.index(step);
      add("chunk", uid, axis.lo(i), axis.hi(i), `[${a}:${b})`, `step ${step} · ${KINDS[kind]} [${a}:${b}) · ${b - a} tokens`);
    }
    const stallSeg = (st, ongoing) => {
      const [uid, a, b, secs] = st;
      if (!set.has(uid) || a === null) return;
      const ia = axis.index(Math.max(a, firstStep)), ib = axis.index(b);
      if (ib >= s.length) return;
      const what = ongoing ? "stalled (still waiting)" : "stall";
      add("stall", uid, axis.lo(ia), axis.hi(ib), "", `${what}: ${Math.round(secs * 1000)} ms without a token`);
    };
    for (const st of rec.stalls) stallSeg(st, false);
    for (const st of rec.ongoing) stallSeg(st, true);
    const styles = {
      waiting: ["waiting", { color: style.wait, opacity: 0.55 }, 0.3],
      // hatching is an SVG pattern per colour: only at detail, where a chunk is wide enough to show it
      chunk: ["prompt chunk [start:end)", labels ? { pattern: { shape: "/", fillmode: "overlay", fgcolor: "white", fgopacity: 0.8 } } : { opacity: 0.6 }, 0.62],
      decode: ["decoding", {}, 0.62],
      stall: ["stall (no token this step)", {}, 0.62],
    };
    const data = [];
    for (const kind of Object.keys(styles)) {
      const [name, extra, width] = styles[kind];
      const g = segs[kind];
      const trace = { type: "bar", orientation: "h", name, y: g.y, x: g.x, base: g.base,
        marker: Object.assign({ color: g.color, line: { width: 0 } }, extra), customdata: g.hover,
        hovertemplate: "%{y} · %{customdata}<extra></extra>", width, yaxis: "y2",
      };
      // labels cost Plotly a text measurement each (20 ms for 40 on a 2-core machine): only
      // where they can be read, at per-request detail
      if (kind === "chunk" && labels && g.text.length <= 40) Object.assign(trace, { text: g.text, textposition: "inside",
        insidetextanchor: "middle", textfont: { color: "white", size: 11 } });
      data.push(trace);
    }
    return { data, labels: shown.map(label) };
  }

  function lane() { return { y: [], base: [], x: [], color: [], text: [], hover: [] }; }

  // ---- the KV pool over time -------------------------------------------------------------------
  function kvFigure(rec, axis, style, pageSize, wholePool, range, widthPx) {
    const s = rec.steps;
    const [i0, i1] = axis.window(range);
    // each pixel's peak step: the fullest the pool was there
    const picks = groups(rec, stepsPerPixel(i1 - i0, widthPx), (i) => s.used[i] + s.cached[i]);
    const at = (col) => picks.map(([, , i]) => col[i]);
    const x = picks.map(([, b]) => (axis.mode === "time" ? s.t1[b] : s.step[b]));
    const data = ["used", "cached", "free"].map((k) => ({ type: "scatter", x, y: at(s[k]),
      name: `${k} pages`, mode: "lines", stackgroup: "kv", fillcolor: style.kv[k],
      line: { width: 0.5, color: style.kv[k], shape: "hv" }, hovertemplate: `${k} %{y} pages<extra></extra>` }));
    const reserved = at(s.reserved).map((r) => Math.ceil(r / pageSize));
    data.push({ type: "scatter", x, y: reserved, mode: "lines",
      name: `reserved (tokens ÷ page size ${pageSize}, in pages)`,
      line: { color: "#222", dash: "dot", width: 2, shape: "hv" }, hovertemplate: "reserved %{y} pages<extra></extra>" });
    const total = Math.max(s.length ? s.total[s.length - 1] : 1, 1);
    let top = Math.max(total, ...reserved.slice(-2000), 0);
    if (!wholePool) {
      let held = 0;
      for (let i = 0; i < s.length; i++) held = Math.max(held, s.used[i] + s.cached[i], Math.ceil(s.reserved[i] / pageSize));
      top = Math.min(top, Math.max(8, Math.ceil(1.3 * held)));
    }
    return { data, layout: { height: 380, uirevision: "kv", hovermode: "x unified",
      margin: { l: 60, r: 20, t: 12, b: 40 },
      showlegend: false, // the legend is HTML above the plot: Plotly would re-measure it every update
      xaxis: { title: { text: style.x_titles[axis.mode] }, autorange: true },
      yaxis: { title: { text: "KV pages" }, range: [0, 1.04 * top] } } };
  }

  // ---- decode progress: cumulative tokens, flat where decoding stalled ------------------------
  function progressFigure(rec, style, widthPx) {
    const s = rec.steps;
    const x = [], y = [];
    let total = 0;
    if (s.length) { x.push(s.t0[0]); y.push(0); }
    const picks = groups(rec, stepsPerPixel(s.length, widthPx), (i) => s.stalled[i]);
    for (const [a, b] of picks) {
      for (let i = a; i <= b; i++) total += s.sampled[i];
      x.push(s.t1[b]); y.push(total);
    }
    const top = Math.max(total, 1) * 1.05;
    const bx = [], bw = [], by = [], bc = [];
    for (const [a, b, i] of picks) if (s.stalled[i]) {
      bx.push((s.t0[a] + s.t1[b]) / 2); bw.push(s.t1[b] - s.t0[a]); by.push(top); bc.push(s.stalled[i]);
    }
    return { data: [
      { type: "bar", x: bx, width: bw, y: by, name: "decode stalled", customdata: bc,
        marker: { color: style.stall, opacity: 0.18, line: { width: 0 } },
        hovertemplate: "%{customdata} decoding request(s) waited<extra></extra>" },
      { type: "scatter", x, y, name: "all requests", mode: "lines",
        line: { color: "#222", width: 3, shape: "hv" }, hovertemplate: "%{y} tokens by %{x:.2f} s<extra></extra>" },
    ], layout: { height: 360, uirevision: "progress", barmode: "overlay",
      margin: { l: 60, r: 20, t: 12, b: 40 },
      showlegend: false, // the legend is HTML above the plot: Plotly would re-measure it every update
      xaxis: { title: { text: style.x_titles.time }, autorange: true },
      yaxis: { title: { text: "generated tokens" }, range: [0, top] } } };
  }

  // ---- legends: HTML, drawn once, so Plotly does not lay them out again on every update ------
  function swatch(label, css) { return `<span><i style="${css}"></i>${label}</span>`; }
  const HATCH = (c) => `background:repeating-linear-gradient(135deg, ${c} 0 3px, #fff 3px 4px)`;

  function legendHtml(view, lod, style) {
    const items = [];
    if (view === "timeline") {
      if (lod === "totals") {
        items.push(swatch("decode tokens (all requests)", "background:#555"),
          swatch("prompt tokens (all requests)", HATCH("#999")));
      } else {
        items.push(swatch("prompt chunk (hatched, request colour)", HATCH(style.palette[0])),
          swatch("decode token (solid)", `background:${style.palette[0]}`));
      }
      items.push(swatch("wasted: the request ended while the step ran", HATCH(style.wasted)),
        swatch("budget (max_extend_tokens)", "border:none;border-top:2px dashed #222;height:0;vertical-align:3px"),
        swatch("decode stalled", `border:none;width:0;height:0;border-left:6px solid transparent;border-right:6px solid transparent;border-bottom:10px solid ${style.stall}`));
      for (const p of style.phases) items.push(swatch(`${p} step`, `background:${style.phase_colors[p]}`));
      items.push(swatch("waiting", `background:${style.wait}`), swatch("stall (no token)", `background:${style.stall}`));
    } else if (view === "kv") {
      for (const k of ["used", "cached", "free"]) items.push(swatch(`${k} pages`, `background:${style.kv[k]}`));
      items.push(swatch("reserved (promised, not yet allocated)", "border:none;border-top:2px dotted #222;height:0;vertical-align:3px"));
    } else {
      items.push(swatch("tokens generated, all requests", "border:none;border-top:3px solid #222;height:0;vertical-align:3px"),
        swatch("a decoding request got no token", `background:${style.stall};opacity:0.3`));
    }
    return items.join("");
  }

  // ---- the view: DOM, updates, pulls ----------------------------------------------------------
  class LiveView {
    constructor(el) {
      this.el = el;
      this.rec = new Record();
      this.id = null;
      this.pulls = 0;
      this.updates = 0;
      this.lastPull = 0;
      this.timer = null;
      this.watchdog = null;
      this.inflight = false;
      this.view = "timeline";
      this.style = null;
      this.engine = {};
      this.times = []; // main-thread ms per update, newest last
      const root = document.createElement("div");
      root.className = "stepscope-live";
      root.innerHTML = `
        <div class="sl-bar" role="tablist">
          <button data-view="timeline" class="sl-on">Timeline</button>
          <button data-view="kv">KV pool</button>
          <button data-view="progress">Decode progress</button>
          <label class="sl-whole"><input type="checkbox"> whole pool</label>
          <span class="sl-status"></span>
        </div>
        <div class="sl-caption"></div>
        <div class="sl-legend"></div>
        <div class="sl-plot sl-timeline"></div>
        <div class="sl-plot sl-kv" style="display:none"></div>
        <div class="sl-plot sl-progress" style="display:none"></div>`;
      el.appendChild(root);
      this.root = root;
      this.plots = { timeline: root.querySelector(".sl-timeline"), kv: root.querySelector(".sl-kv"),
        progress: root.querySelector(".sl-progress") };
      this.status = root.querySelector(".sl-status");
      this.caption = root.querySelector(".sl-caption");
      this.legend = root.querySelector(".sl-legend");
      this.whole = root.querySelector(".sl-whole input");
      this.whole.onchange = () => this.draw();
      root.querySelectorAll("button[data-view]").forEach((b) => {
        b.onclick = () => {
          this.view = b.dataset.view;
          root.querySelectorAll("button[data-view]").forEach((x) => x.classList.toggle("sl-on", x === b));
          for (const [k, p] of Object.entries(this.plots)) p.style.display = k === this.view ? "" : "none";
          this.draw();
        };
      });
      injectStyle();
    }

    receive(component) {
      this.setStateValue = component.setStateValue;
      const data = component.data || {};
      if (data.style) this.style = data.style;
      this.paused = !!data.paused;
      this.xmode = data.xmode || this.xmode || "step";
      this.windowSteps = data.window || this.windowSteps || 500;
      if (data.engine) this.engine = data.engine;
      if (data.captions) this.captions = data.captions;
      this.root.style.display = data.hidden ? "none" : "";
      let applied = false;
      const held = this.rec.steps.length ? this.rec.steps.step[this.rec.steps.length - 1] : null;
      const first = data.steps && data.steps.step.length ? data.steps.step[0] : null;
      // a batch extends what we hold if it starts at or before our next step (batches overlap,
      // since Streamlit may skip a payload); the steps we hold already are dropped
      const extends_ = data.steps && !data.reset && held !== null && (first === null || first <= held + 1);
      if (data.steps && (data.reset || (data.base !== null && data.base === this.id) || extends_)) {
        const start = performance.now();
        if (data.reset) this.rec = new Record();
        applied = this.rec.apply(data, this.windowSteps);
        performance.measure("stepscope-apply", { start, end: performance.now() });
        if (applied) {
          this.id = data.id;
          this.updates++;
          this.answered(data);
          // ask for the next batch before drawing this one: Streamlit's round trip then runs
          // while the browser draws, instead of after it
          this.nextPull(0);
          this.draw();
          const end = performance.now();
          performance.measure("stepscope-update", { start, end });
          this.times.push(end - start);
          if (this.times.length > 600) this.times.shift();
          if (this.updates % 5000 === 0) { // user-timing entries are kept until cleared
            for (const m of ["apply", "plot", "update", "pull"]) performance.clearMeasures("stepscope-" + m);
          }
          return;
        }
      } else if (data.id === this.id && (data.xmode !== this.drawnX || this.paused !== this.drawnPaused)) {
        this.draw();
      }
      this.answered(data);
      // new data we could not use (it extends what we do not hold): right away, from here;
      // nothing new: a bit later
      const stale = data.steps && !applied;
      this.nextPull(stale ? 0 : this.style ? this.style.idle_ms : 500);
    }

    answered(data) {
      if (data.answer !== undefined && data.answer === this.pulls) {
        if (this.inflight) { // the round trip through Streamlit, for the benchmark
          performance.measure("stepscope-pull", { start: this.lastPull, end: performance.now() });
        }
        this.inflight = false; // the answer to our last pull (Streamlit may repeat it: harmless)
        clearTimeout(this.watchdog);
      }
    }

    nextPull(extraDelay) {
      if (!this.paused && !this.inflight && this.timer === null) this.schedulePull(extraDelay);
    }

    schedulePull(extraDelay) {
      if (!this.setStateValue) return;
      const every = this.style ? this.style.pull_ms : 200;
      const wait = Math.max(0, every - (performance.now() - this.lastPull)) + extraDelay;
      if (wait <= 0) { this.pull(); return; }
      this.timer = setTimeout(() => { this.timer = null; this.pull(); }, wait);
    }

    pull() {
      if (this.paused) return;
      this.lastPull = performance.now();
      this.pulls++;
      this.inflight = true;
      this.setStateValue("pull", { have: this.id, n: this.pulls });
      // an answer that never comes (a rerun cut short by another) must not stop the charts
      clearTimeout(this.watchdog);
      this.watchdog = setTimeout(() => { this.inflight = false; this.pull(); }, 3000);
    }

    draw() {
      if (!this.style || !window.Plotly) return;
      const axis = new Axis(this.rec, this.xmode);
      const gd = this.plots[this.view];
      this.drawnX = this.xmode;
      this.drawnPaused = this.paused;
      this.caption.innerHTML = (this.captions || {})[this.view] || "";
      this.whole.parentElement.style.display = this.view === "kv" ? "" : "none";
      let fig;
      if (this.view === "timeline") {
        // a user's zoom (kept by uirevision) decides which steps are in view; switching the
        // x axis between steps and time starts a new revision, so the zoom resets with it
        const full = gd._fullLayout && gd._fullLayout.xaxis;
        const zoomed = full && gd._stepscopeX === this.xmode && full.autorange === false;
        const range = zoomed ? full.range.slice() : null;
        fig = timelineFigure(this.rec, axis, this.style, range, gd.clientWidth || this.el.clientWidth || 1200);
        fig.layout.uirevision = "timeline-" + this.xmode;
        gd._stepscopeX = this.xmode;
        this.lod = fig.detail ? "segments" : "totals";
      } else if (this.view === "kv") {
        const full = gd._fullLayout && gd._fullLayout.xaxis;
        const zoomed = full && gd._stepscopeX === this.xmode && full.autorange === false;
        fig = kvFigure(this.rec, axis, this.style, this.engine.page_size || 1, this.whole.checked,
          zoomed ? full.range.slice() : null, gd.clientWidth || this.el.clientWidth || 1200);
        gd._stepscopeX = this.xmode;
      } else {
        fig = progressFigure(this.rec, this.style, gd.clientWidth || this.el.clientWidth || 1200);
      }
      const t = performance.now();
      window.Plotly.react(gd, fig.data, fig.layout, { displaylogo: false, scrollZoom: false, responsive: true });
      performance.measure("stepscope-plot", { start: t, end: performance.now() });
      if (!gd._stepscopeHooked && gd.on) {
        // zooming or panning changes what is in view (and its level of detail): redraw then
        // too, so a paused page is still drawn in full wherever the user looks
        gd._stepscopeHooked = true;
        gd.on("plotly_relayout", () => {
          cancelAnimationFrame(this.raf);
          this.raf = requestAnimationFrame(() => this.draw());
        });
      }
      const legend = legendHtml(this.view, this.lod, this.style);
      if (legend !== this.legendShown) { this.legend.innerHTML = legend; this.legendShown = legend; }
      const n = this.rec.steps.length;
      const last = n ? this.rec.steps.step[n - 1] : null;
      this.status.textContent = n
        ? `${n} steps held (last #${last})` + (this.view === "timeline" ? ` · ${fig.nView} in view · ${this.lod === "segments" ? "per-request segments" : "per-step totals (zoom in for requests)"}` : "") + (this.paused ? " · paused" : "")
        : "No engine steps recorded yet: submit a prompt.";
      Object.assign(this.root.dataset, { updates: this.updates, steps: n, lod: this.lod || "", last: last === null ? "" : last });
    }

    destroy() {
      clearTimeout(this.timer);
      clearTimeout(this.watchdog);
      for (const p of Object.values(this.plots)) if (window.Plotly) window.Plotly.purge(p);
    }
  }

  // ---- the KV page map ------------------------------------------------------------------------
  const STATE_NAMES = ["free", "cached", "used", "shared"];

  class PageMap {
    constructor(el) {
      this.el = el;
      const root = document.createElement("div");
      root.className = "stepscope-kvmap";
      root.innerHTML = `<div class="sl-caption"></div><canvas></canvas><div class="sl-tip"></div><div class="sl-legend"></div>`;
      el.appendChild(root);
      this.root = root;
      this.canvas = root.querySelector("canvas");
      this.tip = root.querySelector(".sl-tip");
      this.canvas.onmousemove = (e) => this.hover(e);
      this.canvas.onmouseleave = () => { this.tip.style.display = "none"; };
      injectStyle();
    }

    receive(component) {
      const data = component.data || {};
      const map = data.map;
      this.style = data.style || this.style;
      if (!map) {
        this.root.querySelector(".sl-caption").textContent = data.message || "Waiting for the engine's page map…";
        return;
      }
      const start = performance.now();
      this.map = map;
      this.draw();
      performance.measure("stepscope-kvmap", { start, end: performance.now() });
    }

    draw() {
      const m = this.map, style = this.style;
      const n = m.num_pages;
      const width = Math.max(200, (this.el.clientWidth || 1000) - 4);
      // as many pages per cell as it takes to keep the grid under ~40,000 cells
      const per = Math.max(1, Math.ceil(n / 40000));
      const cells = Math.ceil(n / per);
      const size = Math.max(3, Math.min(14, Math.floor(Math.sqrt((width * 420) / cells))));
      const cols = Math.max(1, Math.floor(width / size));
      const rows = Math.ceil(cells / cols);
      const c = this.canvas;
      c.width = cols * size; c.height = rows * size;
      const g = c.getContext("2d");
      g.fillStyle = style.kv.free; g.fillRect(0, 0, c.width, c.height);
      const owners = new Map();
      const counts = [0, 0, 0, 0];
      let page = 0;
      this.cellInfo = new Array(cells);
      for (const [len, state, uid, sharers] of m.runs) {
        counts[state] += len;
        if (state >= 2) owners.set(uid, (owners.get(uid) || 0) + len);
        for (let k = 0; k < len; k++, page++) {
          const cell = Math.floor(page / per);
          if (page % per && state === 0) continue; // a cell shows the first non-free page in it
          this.cellInfo[cell] = [page, state, uid, sharers];
          const x = (cell % cols) * size, y = Math.floor(cell / cols) * size;
          const fill = state === 0 ? style.kv.free : state === 1 ? style.kv.cached : color(style, uid);
          g.fillStyle = fill;
          g.fillRect(x, y, size - (size > 4 ? 1 : 0), size - (size > 4 ? 1 : 0));
          if (state === 3) { // shared prefix page: a white diagonal, like the prompt hatching
            g.strokeStyle = "white"; g.lineWidth = Math.max(1, size / 5);
            g.beginPath(); g.moveTo(x, y + size - 1); g.lineTo(x + size - 1, y); g.stroke();
          }
        }
      }
      // pages promised to admitted requests but not allocated yet: outlined among the free ones
      let promised = Math.ceil((m.reserved_pages || 0) / per);
      g.strokeStyle = "#222"; g.lineWidth = 1;
      for (let cell = cells - 1; cell >= 0 && promised > 0; cell--) {
        const info = this.cellInfo[cell];
        if (info && info[1] !== 0) continue;
        const x = (cell % cols) * size, y = Math.floor(cell / cols) * size;
        g.strokeRect(x + 0.5, y + 0.5, size - 2, size - 2);
        promised--;
      }
      this.geom = { size, cols, per };
      const caption = this.root.querySelector(".sl-caption");
      caption.textContent = `${n.toLocaleString()} pages × ${m.page_size} token(s)` + (per > 1 ? ` · one cell per ${per} pages` : "")
        + ` · used ${counts[2].toLocaleString()} · shared (prefix-cache hits) ${counts[3].toLocaleString()} · cached ${counts[1].toLocaleString()} · free ${counts[0].toLocaleString()}`
        + ` · reserved, not yet allocated: ${(m.reserved_pages || 0).toLocaleString()} pages (${(m.reserved_tokens || 0).toLocaleString()} tokens)`;
      const legend = [["free", style.kv.free], ["cached (evictable)", style.kv.cached]]
        .map(([t, col]) => `<span><i style="background:${col}"></i>${t}</span>`).join("")
        + `<span><i class="sl-shared"></i>shared prefix page (radix hit)</span><span><i class="sl-promised"></i>promised, not allocated</span>`
        + [...owners.keys()].sort((a, b) => a - b).slice(0, 40)
          .map((u) => `<span><i style="background:${color(style, u)}"></i>req ${u}</span>`).join("");
      this.root.querySelector(".sl-legend").innerHTML = legend;
      const summary = { free: counts[0], cached: counts[1], used: counts[2], shared: counts[3],
        owners: Object.fromEntries(owners), t: m.t };
      this.root.dataset.summary = JSON.stringify(summary);
    }

    hover(e) {
      if (!this.geom) return;
      const r = this.canvas.getBoundingClientRect();
      const col = Math.floor((e.clientX - r.left) / this.geom.size), row = Math.floor((e.clientY - r.top) / this.geom.size);
      const cell = row * this.geom.cols + col;
      const info = this.cellInfo && this.cellInfo[cell];
      if (!info) { this.tip.style.display = "none"; return; }
      const [page, state, uid, sharers] = info;
      const who = state >= 2 ? ` · req ${uid}` + (sharers > 1 ? ` and ${sharers - 1} more share it` : "") : "";
      this.tip.textContent = `page ${page} · ${STATE_NAMES[state]}${who}`;
      Object.assign(this.tip.style, { display: "block", left: `${e.clientX - r.left + 12}px`, top: `${e.clientY - r.top + 12}px` });
    }

    destroy() {}
  }

  let styled = false;
  function injectStyle() {
    if (styled) return;
    styled = true;
    const css = document.createElement("style");
    css.textContent = `
      .stepscope-live .sl-bar { display:flex; gap:6px; align-items:center; margin-bottom:4px; flex-wrap:wrap; }
      .stepscope-live .sl-bar button { border:1px solid #ccc; background:#fff; border-radius:6px; padding:2px 10px; cursor:pointer; font-size:14px; }
      .stepscope-live .sl-bar button.sl-on { background:#262730; color:#fff; border-color:#262730; }
      .stepscope-live .sl-status { color:#777; font-size:13px; margin-left:auto; }
      .stepscope-live .sl-whole { font-size:13px; color:#444; }
      .stepscope-live .sl-caption, .stepscope-kvmap .sl-caption { color:#666; font-size:13px; margin:2px 0 4px; }
      .stepscope-live .sl-legend { display:flex; flex-wrap:wrap; gap:2px 14px; font-size:12px; color:#333; margin:2px 0 0 60px; }
      .stepscope-live .sl-legend i { display:inline-block; width:14px; height:11px; margin-right:5px; vertical-align:-1px; border:1px solid #ccc; }
      .stepscope-kvmap { position:relative; }
      .stepscope-kvmap canvas { display:block; }
      .stepscope-kvmap .sl-tip { position:absolute; display:none; background:#222; color:#fff; font-size:12px; padding:2px 6px; border-radius:4px; pointer-events:none; }
      .stepscope-kvmap .sl-legend { display:flex; flex-wrap:wrap; gap:4px 12px; font-size:12px; color:#444; margin-top:6px; }
      .stepscope-kvmap .sl-legend i { display:inline-block; width:11px; height:11px; margin-right:4px; vertical-align:-1px; border:1px solid #bbb; }
      .stepscope-kvmap .sl-legend i.sl-shared { background:linear-gradient(135deg, #1f77b4 45%, #fff 45%, #fff 55%, #1f77b4 55%); }
      .stepscope-kvmap .sl-legend i.sl-promised { background:#ececec; border:1px solid #222; }`;
    document.head.appendChild(css);
  }

  window.stepscopeLive = {
    render(component) {
      const el = component.parentElement;
      const mode = (component.data || {}).mode || "charts";
      let view = views.get(el);
      if (!view) {
        view = mode === "kvmap" ? new PageMap(el) : new LiveView(el);
        views.set(el, view);
      }
      view.receive(component);
    },
    unmount(el) {
      // Called when Streamlit drops the element; a re-render of the same element keeps it.
      setTimeout(() => {
        const view = views.get(el);
        if (view && !el.isConnected) { view.destroy(); views.delete(el); }
      }, 0);
    },
    views,
    unpackItems, // for tests/test_app_live.py, which runs these in Node against encode.py
    expandColumns,
  };
})();
