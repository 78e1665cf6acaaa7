// Decode progress (cumulative tokens, flat where decoding stalled) and inter-token latency.
(function (S) {
  "use strict";
  const { stepsPerPixel, groups, color } = S;
  const MAX_POINTS = 4000; // past this, each few steps keep only their highest and lowest gaps

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
