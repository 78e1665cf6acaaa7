// The KV pool over time: used, cached and free pages per step, and what is promised.
(function (S) {
  "use strict";
  const { stepsPerPixel, groups } = S;

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
    // pool-full moments: a step whose decodes found no page left (it retracted requests), or
    // one that left nothing free or evictable
    const fx = [], fy = [];
    picks.forEach(([a, b], k) => {
      for (let i = a; i <= b; i++) {
        if (s.retracted[i] > 0 || (s.free[i] === 0 && s.cached[i] === 0)) { fx.push(x[k]); fy.push(total); break; }
      }
    });
    data.push({ type: "scatter", x: fx, y: fy, mode: "markers", name: "pool full",
      marker: { color: style.stall, symbol: "triangle-down", size: 8 }, hovertemplate: "pool full: no page left for the decodes (%{y} pages)<extra></extra>" });
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

  S.kvFigure = kvFigure;
})(window.stepscope = window.stepscope || {});
