// The timeline: batch composition per step on top, one lane per request below.
(function (S) {
  "use strict";
  const { KINDS, WAIT_REASONS, lowerBound, color, stepsPerPixel, groups } = S;
  const CLEAR = "rgba(0,0,0,0)";
  const MAX_WAIT_LINES = 6; // causes a hovered wait lists (the largest first)
  const MAX_REASON_RUNS = 6; // runs of waiting reasons a hovered waiting stretch lists

  // `fixed` (compare): {x: [lo, hi], y_top} the same for every recording compared, so the same
  // place on the page is the same moment, and bars of the same height are the same size
  function timelineFigure(rec, axis, style, range, widthPx, fixed) {
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
    const yTop = 1.12 * (fixed ? Math.max(fixed.y_top, 1) : budgetVisible ? Math.max(top, budgetMax) : top);
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
    // retractions (optimistic admission ran out of pages): a marker on top of the step
    const rx = [], ry = [], rc = [];
    for (const [a, b, peak] of groups(rec, k, (i) => s.retracted[i])) {
      if (s.retracted[peak]) { rx.push((axis.lo(a) + axis.hi(b)) / 2); ry.push(0.93 * yTop); rc.push(s.retracted[peak]); }
    }
    data.push({ type: "scatter", x: rx, y: ry, mode: "markers", name: "retracted",
      marker: { color: style.stall, symbol: "x-thin", size: 12, line: { width: 3, color: style.stall } }, customdata: rc,
      hovertemplate: "%{customdata} request(s) retracted: the pool ran out of pages<extra></extra>" });
    const lanes = laneTraces(rec, axis, style, detail);
    data.push(...lanes.data);
    const lanePx = 26 * Math.max(lanes.labels.length, 3);
    const batchPx = 300;
    const split = lanePx / (lanePx + batchPx);
    const annotations = budgetVisible ? [] : [{ text: `budget ${budgetMax} ↑ (above the chart)`,
      xref: "paper", yref: "y domain", x: 1, y: 1, xanchor: "right", yanchor: "top", showarrow: false }];
    if (lanes.total > lanes.labels.length) { // in the gap between the bars and the lanes
      annotations.push({ xref: "paper", yref: "paper", x: 0, y: split, xanchor: "left", yanchor: "bottom",
        showarrow: false, font: { size: 12, color: "#444" },
        text: `Lanes of the newest ${lanes.labels.length} of the ${lanes.total} requests held; the ` +
          `${lanes.total - lanes.labels.length} older ones have none (the bars above count every request).` });
    }
    const layout = {
      height: batchPx + lanePx + 130, barmode: "overlay", uirevision: "timeline",
      margin: { l: 60, r: 20, t: 12, b: 40 }, hovermode: "closest",
      showlegend: false, // the legend is HTML above the plot: Plotly would re-measure it every update
      xaxis: Object.assign({ title: { text: style.x_titles[axis.mode] }, anchor: "y2", autorange: true },
        fixed ? { range: fixed.x, autorange: false } : {}),
      yaxis: { title: { text: "tokens in step" }, range: [-0.09 * yTop, yTop], domain: [split + 0.06, 1] },
      yaxis2: { title: { text: "request" }, type: "category", categoryorder: "array",
        categoryarray: lanes.labels.slice().reverse(), domain: [0, split], anchor: "x" },
      uniformtext: { minsize: 9, mode: "hide" }, annotations, shapes,
    };
    return { data, layout, detail, nView, lanes: [lanes.labels.length, lanes.total] };
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
      // an explicit clear background: an overlay pattern over per-bar colours otherwise made
      // Plotly log "Invalid color specifier" (a console.trace) per bar, every draw
      marker: { color: p.color, pattern: Object.assign({ fgcolor: "white", fgopacity: 0.8, size: 6, bgcolor: CLEAR }, pattern), line: { width: 0 } },
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
    if (!s.length) return { data: [], labels: [], total: 0 };
    const firstStep = s.step[0], endX = axis.hi(s.length - 1), startX = axis.lo(0);
    const uids = [...rec.firstItemStep.keys()];
    for (const [uid, r] of rec.requests) if (r.state === "waiting" && !rec.firstItemStep.has(uid)) uids.push(uid);
    const shown = uids.slice(-style.max_lanes);
    const label = (u) => `req ${u}`;
    const segs = { waiting: lane(), chunk: lane(), decode: lane(), stall: lane(), retracted: lane() };
    // why the head of the queue waited in the steps at indices i0..i1 (each step record's
    // waiting reason), as runs of steps
    const why = (i0, i1) => {
      const runs = [];
      for (let i = Math.max(i0, 0); i <= Math.min(i1, s.length - 1); i++) {
        const r = WAIT_REASONS[s.reason[i]] || "no reason named";
        const last = runs[runs.length - 1];
        if (last && last[0] === r) last[2] = s.step[i]; else runs.push([r, s.step[i], s.step[i]]);
      }
      if (!runs.length) return "";
      const lines = runs.slice(-MAX_REASON_RUNS).map(([r, a, b]) => `· ${a === b ? `step ${a}` : `steps ${a}–${b}`}: ${r}`);
      return "<br>the head of the queue waited for:<br>" + (runs.length > MAX_REASON_RUNS ? "· …<br>" : "") +
        lines.join("<br>") + "<br>(admission is FIFO: a request behind the head waits for the head's reason)";
    };
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
        const iEnd = first === undefined ? s.length - 1 : axis.index(first) - 1;
        const iStart = lowerBound(s.t1, r.t_queued); // the first step that ended after it came
        if (x1 > x0) add("waiting", uid, x0, x1, "", "waiting for admission" + why(iStart, iEnd));
      }
      for (const [a, b] of rec.runs.get(uid) || []) {
        const ia = axis.index(Math.max(a, firstStep)), ib = axis.index(b);
        add("decode", uid, axis.lo(ia), axis.hi(ib), "", `decode steps ${s.step[ia]}–${b} · ${b - s.step[ia] + 1} tokens`);
      }
    }
    // a retracted request: the gap from its retraction to its recompute's first chunk
    for (const [step, uid] of rec.retractions) {
      if (!set.has(uid)) continue;
      const ia = axis.index(step);
      if (ia >= s.length) continue;
      const back = rec.chunks.find((c) => c[1] === uid && c[0] >= step && c[4] === 3);
      const ib = back ? axis.index(back[0]) : s.length;
      const x1 = ib < s.length ? axis.lo(ib) : endX;
      add("retracted", uid, axis.lo(ia), x1, "", `retracted at step ${step}: KV freed, waiting to be recomputed` + why(ia, ib - 1));
    }
    for (const [step, uid, a, b, kind] of rec.chunks) {
      if (!set.has(uid)) continue;
      const i = axis.index(step);
      // the piece that sampled the first token says what that token waited for
      const waited = kind === 1 ? rec.firsts.get(uid) : undefined;
      add("chunk", uid, axis.lo(i), axis.hi(i), `[${a}:${b})`, `step ${step} · ${KINDS[kind]} [${a}:${b}) · ${b - a} tokens` +
        (waited ? "<br>its first token " + waitLines(waited) : ""));
    }
    const stallSeg = (st, ongoing) => {
      const [uid, a, b, secs] = st;
      if (!set.has(uid) || a === null) return;
      const ia = axis.index(Math.max(a, firstStep)), ib = axis.index(b);
      if (ib >= s.length) return;
      const what = ongoing ? "stalled (still waiting)" : "stall";
      const waited = ongoing ? st[4] : rec.waits.get(uid + ":" + a);
      add("stall", uid, axis.lo(ia), axis.hi(ib), "", `${what}: ${Math.round(secs * 1000)} ms without a token` +
        (waited ? "<br>" + (ongoing ? "so far it " : "it ") + waitLines(waited) : ""));
    };
    for (const st of rec.stalls) stallSeg(st, false);
    for (const st of rec.ongoing) stallSeg(st, true);
    const styles = {
      waiting: ["waiting", { color: style.wait, opacity: 0.55 }, 0.3],
      // hatching is an SVG pattern per colour: only at detail, where a chunk is wide enough to show it
      chunk: ["prompt chunk [start:end)", labels ? { pattern: { shape: "/", fillmode: "overlay", fgcolor: "white", fgopacity: 0.8, bgcolor: CLEAR } } : { opacity: 0.6 }, 0.62],
      decode: ["decoding", {}, 0.62],
      stall: ["stall (no token this step)", {}, 0.62],
      retracted: ["retracted (waiting to be recomputed)", { color: "#444", opacity: 0.85, pattern: { shape: "x", fgcolor: "#fff", fgopacity: 0.9, size: 5 } }, 0.45],
    };
    const data = [];
    for (const kind of Object.keys(styles)) {
      const [name, extra, width] = styles[kind];
      const g = segs[kind];
      const trace = { type: "bar", orientation: "h", name, y: g.y, x: g.x, base: g.base,
        marker: Object.assign({ color: g.color, line: { width: 0 } }, extra), customdata: g.hover,
        hovertemplate: "%{y} · %{customdata}<extra></extra>", width, yaxis: "y2",
        hoverlabel: { align: "left" }, // a wait's causes, one a line
      };
      // labels cost Plotly a text measurement each (20 ms for 40 on a 2-core machine): only
      // where they can be read, at per-request detail
      if (kind === "chunk" && labels && g.text.length <= 40) Object.assign(trace, { text: g.text, textposition: "inside",
        insidetextanchor: "middle", textfont: { color: "white", size: 11 } });
      data.push(trace);
    }
    return { data, labels: shown.map(label), total: uids.length };
  }

  function lane() { return { y: [], base: [], x: [], color: [], text: [], hover: [] }; }

  // a wait in words (instrumentation's GapDelay.describe(): "38 ms: 31 ms request 9's prompt
  // [512:768] in steps 812–814, 7 ms own decode in step 815"), one cause a line
  function waitLines(text) {
    const k = text.indexOf(": ");
    if (k < 0) return "waited " + text;
    const parts = text.slice(k + 2).split(", ");
    const shown = parts.slice(0, MAX_WAIT_LINES).map((p) => "· " + p);
    if (parts.length > MAX_WAIT_LINES) shown.push(`· and ${parts.length - MAX_WAIT_LINES} more`);
    return `waited ${text.slice(0, k)}:<br>` + shown.join("<br>");
  }

  S.timelineFigure = timelineFigure;
})(window.stepscope = window.stepscope || {});
