// The data the live charts hold in the browser: a batch of new steps (app/live/encode.py) is
// unpacked and appended to columns, the last `window` steps kept. Shared by every chart file
// (timeline.js, kv.js, progress.js) through `window.stepscope`.
(function (S) {
  "use strict";
  // encode.STEP_COLUMNS
  const STEP_COLS = ["step", "t0", "t1", "phase", "budget", "used", "cached", "free", "total",
    "reserved", "waiting", "running", "prompt", "decode", "wasted", "stalled", "sampled",
    "retracted", "reason"];
  const ITEM_COLS = ["step", "uid", "kind", "a", "b", "base", "w"];
  const KINDS = ["chunk", "prefill", "decode", "recompute"];
  // a step's `reason` code: why the head of the waiting queue was not admitted (encode.REASONS)
  const WAIT_REASONS = [null, "budget", "kv", "max_running", "reserved"];
  const MAX_RETRACTIONS = 4000;
  const MAX_FIRSTS = 400; // first tokens' waits kept (more than the lanes drawn)
  const REQ_FIELDS = ["uid", "state", "t_queued", "t_first_token", "t_finished"];
  const REF_KEEP = 16; // decode stacks kept at batch ends, for batches that overlap what we hold
  const HALF = 0.45; // a step's bar half-width in step units

  // ---- the data the browser holds ------------------------------------------------------------
  class Columns {
    constructor(names) { this.names = names; this.clear(); }
    clear() { for (const n of this.names) this[n] = []; this.length = 0; }
    push(cols, n) {
      for (const name of this.names) {
        const src = cols[name];
        const dst = this[name];
        for (let i = 0; i < n; i++) dst.push(src ? src[i] : null);
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
      this.retractions = []; // [step, uid]: retracted when that step was scheduled
      this.ongoing = [];
      this.runs = new Map(); // uid -> [[firstStep, lastStep], ...] steps that gave it a token
      this.chunks = []; // [step, uid, a, b, kind] prompt pieces
      this.firstItemStep = new Map(); // uid -> first step it appeared in
      // waits in words (feed.describe_waits): "uid:first step" of a stall -> what it waited
      // for; uid -> what its first token waited for
      this.waits = new Map();
      this.firsts = new Map();
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
      const seenR = new Set(this.retractions.map((x) => x[0] + ":" + x[1]));
      for (const r of batch.retractions || []) if (!seenR.has(r[0] + ":" + r[1])) this.retractions.push(r);
      if (this.retractions.length > MAX_RETRACTIONS) this.retractions.splice(0, this.retractions.length - MAX_RETRACTIONS);
      const waits = batch.waits || []; // a repeated text comes as the index of its first row
      for (const [uid, a, t] of waits) this.waits.set(uid + ":" + a, typeof t === "number" ? waits[t][2] : t);
      for (const [uid, text] of batch.firsts || []) this.firsts.set(uid, text);
      while (this.firsts.size > MAX_FIRSTS) this.firsts.delete(this.firsts.keys().next().value);
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
      if (this.waits.size) {
        const kept = new Set(this.stalls.map((x) => x[0] + ":" + x[1]));
        for (const key of [...this.waits.keys()]) if (!kept.has(key)) this.waits.delete(key);
      }
      this.retractions = this.retractions.filter((x) => x[0] >= first);
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


  // ---- level of detail, shared by the charts -------------------------------------------------
  // as app.live.style.request_color: Python's modulo, never negative
  function color(style, uid) {
    const n = style.palette.length;
    return style.palette[(((Math.trunc(uid) || 0) % n) + n) % n];
  }

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

  S.STEP_COLS = STEP_COLS;
  S.ITEM_COLS = ITEM_COLS;
  S.KINDS = KINDS;
  S.WAIT_REASONS = WAIT_REASONS;
  S.REQ_FIELDS = REQ_FIELDS;
  S.Columns = Columns;
  S.lowerBound = lowerBound;
  S.unpackItems = unpackItems;
  S.expandColumns = expandColumns;
  S.Record = Record;
  S.Axis = Axis;
  S.color = color;
  S.stepsPerPixel = stepsPerPixel;
  S.groups = groups;
})(window.stepscope = window.stepscope || {});
