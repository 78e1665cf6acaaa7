// Decode progress (cumulative tokens, flat where decoding stalled) and inter-token latency.
(function (S) {
  "use strict";
  const { stepsPerPixel, groups, color } = S;
  const MAX_POINTS = 4000; // past this, each few steps keep only their highest and lowest gaps

  // Each request's tokens so far, one line per request (at most `max` of them, else none):
  // a prefill samples its first token, a decode one more, and a recompute piece followed by
  // a decode ended the recompute and sampled one. Points are kept per group of k steps, as the
  // total's are, so a line costs at most a point per two pixels.
  function requestLines(rec, style, k, max) {
    const s = rec.steps, it = rec.items;
    const per = new Map(); // uid -> {x, y, n, kind (its last item's), t, g}
    const add = (p, t, step) => {
      p.n++;
      const g = Math.floor(step / k);
      if (g === p.g && p.x.length > 1) { p.x[p.x.length - 1] = t; p.y[p.y.length - 1] = p.n; } else { p.x.push(t); p.y.push(p.n); }
      p.g = g;
    };
    let i = 0;
    for (let j = 0; j < it.length; j++) {
      if (it.w[j]) continue; // wasted work sampled nothing
      while (s.step[i] < it.step[j]) i++;
      const uid = it.uid[j], kind = it.kind[j];
      let p = per.get(uid);
      if (!p) {
        if (per.size >= max) return { data: [], requests: countRequests(it, max) };
        p = { x: [s.t0[i]], y: [0], n: 0, kind: -1, t: 0, step: 0, g: null };
        per.set(uid, p);
      }
      if (kind === 2 && p.kind === 3) add(p, p.t, p.step);
      if (kind === 1 || kind === 2) add(p, s.t1[i], s.step[i]);
      Object.assign(p, { kind, t: s.t1[i], step: s.step[i] });
    }
    const data = [];
    for (const [uid, p] of per) {
      data.push({ type: "scatter", x: p.x, y: p.y, mode: "lines", name: `req ${uid}`,
        line: { color: color(style, uid), width: 1.5, shape: "hv" }, customdata: p.x.map(() => uid),
        hovertemplate: "req %{customdata}: %{y} tokens by %{x:.2f} s<extra></extra>" });
    }
    return { data, requests: per.size };
  }

  function countRequests(it, max) {
    const uids = new Set();
    for (let j = 0; j < it.length; j++) if (!it.w[j]) uids.add(it.uid[j]);
    return Math.max(uids.size, max + 1);
  }

  function progressFigure(rec, style, widthPx) {
    const s = rec.steps;
    const x = [], y = [];
    let total = 0;
    if (s.length) { x.push(s.t0[0]); y.push(0); }
    const k = stepsPerPixel(s.length, widthPx);
    const picks = groups(rec, k, (i) => s.stalled[i]);
    for (const [a, b] of picks) {
      for (let i = a; i <= b; i++) total += s.sampled[i];
      x.push(s.t1[b]); y.push(total);
    }
    const top = Math.max(total, 1) * 1.05;
    const bx = [], bw = [], by = [], bc = [];
    for (const [a, b, i] of picks) if (s.stalled[i]) {
      bx.push((s.t0[a] + s.t1[b]) / 2); bw.push(s.t1[b] - s.t0[a]); by.push(top); bc.push(s.stalled[i]);
    }
    const max = style.max_lines || style.max_lanes || 40;
    const lines = requestLines(rec, style, k, max);
    const annotations = lines.requests > max ? [{ xref: "paper", yref: "paper", x: 0.01, y: 0.99,
      xanchor: "left", yanchor: "top", showarrow: false, font: { size: 12, color: "#444" },
      text: `${lines.requests} requests in view: only their total is drawn (a line per request up to ${max}: narrow Steps in view for them)` }] : [];
    return { data: [
      { type: "bar", x: bx, width: bw, y: by, name: "decode stalled", customdata: bc,
        marker: { color: style.stall, opacity: 0.18, line: { width: 0 } },
        hovertemplate: "%{customdata} decoding request(s) waited<extra></extra>" },
      ...lines.data,
      { type: "scatter", x, y, name: "all requests", mode: "lines",
        line: { color: "#222", width: 3, shape: "hv" }, hovertemplate: "%{y} tokens by %{x:.2f} s, all requests<extra></extra>" },
    ], lines: lines.data.length, layout: { height: 360, uirevision: "progress", barmode: "overlay",
      margin: { l: 60, r: 20, t: 12, b: 40 }, annotations,
      showlegend: false, // the legend is HTML above the plot: Plotly would re-measure it every update
      xaxis: { title: { text: style.x_titles.time }, autorange: true },
      yaxis: { title: { text: "generated tokens" }, range: [0, top] } } };
  }

  // Each token's gap since the same request's previous token, at the step that sampled it.
  // Red: the token that ended a stall, as encode.py found it (the protocol's rule,
  // instrumentation.metrics.stalled_between), so the red points are the lanes' red segments.
  function itlFigure(rec, axis, style, widthPx) {
    const s = rec.steps, it = rec.items;
    const ended = new Set(rec.stalls.map((x) => x[0] + ":" + (x[2] + 1)));
    const last = new Map(); // uid -> t1 of its previous token
    const pts = { x: [], y: [], c: [], cd: [] }, red = { x: [], y: [], cd: [] };
    let i = 0, worst = null;
    for (let j = 0; j < it.length; j++) {
      if (it.w[j] || it.kind[j] === 0) continue; // a chunk samples nothing; wasted work neither
      while (s.step[i] < it.step[j]) i++;
      const uid = it.uid[j], t = s.t1[i], prev = last.get(uid);
      last.set(uid, t);
      if (prev === undefined) continue;
      const ms = 1000 * (t - prev), x = axis.mode === "time" ? t : s.step[i];
      const stall = ended.has(uid + ":" + s.step[i]);
      const into = stall ? red : pts;
      into.x.push(x); into.y.push(ms); into.cd.push([uid, s.step[i]]);
      if (!stall) pts.c.push(color(style, uid));
      if (!worst || ms > worst.ms) worst = { ms, x, uid, stall };
    }
    const thin = thinned(pts, s, stepsPerPixel(s.length, widthPx));
    const hover = "req %{customdata[0]} · step %{customdata[1]} · %{y:.0f} ms since its last token";
    const data = [
      { type: "scatter", mode: "markers", x: thin.x, y: thin.y, customdata: thin.cd, name: "inter-token latency",
        marker: { color: thin.c, size: 4, opacity: 0.7 }, hovertemplate: hover + "<extra></extra>" },
      { type: "scatter", mode: "markers", x: red.x, y: red.y, customdata: red.cd, name: "after a stall",
        marker: { color: style.stall, size: 8 }, hovertemplate: hover + " (a stall)<extra></extra>" },
    ];
    const annotations = worst ? [{ x: worst.x, y: worst.ms, ax: -60, ay: -30, arrowhead: 2, showarrow: true,
      text: `${worst.stall ? "worst stall" : "longest gap (no stall)"}: ${worst.ms.toFixed(0)} ms · req ${worst.uid}`,
      font: { color: worst.stall ? style.stall : "#333", size: 12 } }]
      : [{ text: "No request has two tokens in view yet.", xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false }];
    return { data, layout: { height: 360, uirevision: "latency-" + axis.mode, hovermode: "closest",
      margin: { l: 60, r: 20, t: 12, b: 40 }, showlegend: false, annotations,
      xaxis: { title: { text: style.x_titles[axis.mode] }, autorange: true },
      yaxis: { title: { text: "inter-token latency (ms)" }, rangemode: "tozero" } } };
  }

  // At most MAX_POINTS ordinary points: per group of k steps, the highest and the lowest gap.
  function thinned(pts, s, k) {
    if (pts.x.length <= MAX_POINTS) return pts;
    const keep = new Map(); // group -> [index of max, index of min]
    pts.cd.forEach(([, step], n) => {
      const g = Math.floor(step / k), had = keep.get(g);
      if (!had) { keep.set(g, [n, n]); return; }
      if (pts.y[n] > pts.y[had[0]]) had[0] = n;
      if (pts.y[n] < pts.y[had[1]]) had[1] = n;
    });
    const out = { x: [], y: [], c: [], cd: [] };
    for (const [a, b] of keep.values()) for (const n of a === b ? [a] : [a, b]) {
      out.x.push(pts.x[n]); out.y.push(pts.y[n]); out.c.push(pts.c[n]); out.cd.push(pts.cd[n]);
    }
    return out;
  }

  S.progressFigure = progressFigure;
  S.itlFigure = itlFigure;
})(window.stepscope = window.stepscope || {});
