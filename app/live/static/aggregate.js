// Steps that carry counts, not request ids (an external engine watched through
// `python -m instrumentation.watch`): batch composition, KV usage, queue and throughput per step,
// and a tensor-parallel engine's time per rank. Only what the source said is drawn: a missing
// value (null) is a gap, never a zero, and a log line that summarises N steps is marked as a
// sample of N steps. The fields are app.aggregate's, as encode.py sends them (a_* columns).
(function (S) {
  "use strict";
  const PROMPT = "#999", DECODE = "#555";
  const RANK_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22", "#7f7f7f"];

  function hover(s, i) {
    const parts = [`step ${s.step[i]} · ${["prefill", "decode", "mixed"][s.phase[i]] || "?"}`];
    if (s.a_sample[i] > 1) parts.push(`sample of ${s.a_sample[i]} steps`);
    for (const [label, v] of [["prompt tokens", s.a_prompt[i]], ["cached tokens", s.a_cached[i]],
      ["decode tokens", s.a_dtok[i]], ["decode requests", s.a_dreq[i]], ["budget", s.budget[i] || null],
      ["waiting", s.a_wait[i]], ["running", s.a_run[i]]]) {
      if (v !== null && v !== undefined) parts.push(`${label} ${v.toLocaleString()}`);
    }
    if (s.a_usage[i] !== null && s.a_usage[i] !== undefined) parts.push(`KV usage ${Math.round(100 * s.a_usage[i])}%`);
    if (s.a_tps[i] !== null && s.a_tps[i] !== undefined) parts.push(`${s.a_tps[i].toFixed(1)} gen tokens/s`);
    return parts.join("<br>");
  }

  const known = (col) => col.some((v) => v !== null && v !== undefined);

  function line(name, x, y, text, color, yaxis) {
    return { type: "scatter", mode: "lines+markers", name, x, y, yaxis, connectgaps: false,
      line: { color, shape: "hv", width: 1.5 }, marker: { size: 4, color }, hovertext: text, hoverinfo: "text" };
  }

  function aggregateFigure(rec, axis, style) {
    const s = rec.steps, n = s.length;
    const idx = [...Array(n).keys()];
    const x = idx.map((i) => (axis.mode === "time" ? s.t1[i] : s.step[i]));
    const text = idx.map((i) => hover(s, i));
    // the decode bar counts tokens where the source says them, else running decode requests
    const decode = idx.map((i) => (s.a_dtok[i] !== null && s.a_dtok[i] !== undefined ? s.a_dtok[i] : s.a_dreq[i]));
    const bar = (name, y, marker) => ({ type: "bar", name, x, y, yaxis: "y", hovertext: text, hoverinfo: "text",
      marker: Object.assign({ line: { width: 0 } }, marker) });
    const data = [bar("decode", decode, { color: DECODE }),
      bar("prompt tokens computed", s.a_prompt.slice(), { color: PROMPT, pattern: { shape: "/", fillmode: "overlay", fgcolor: "white" } })];
    if (s.a_cached.some((v) => v)) { // served from the prefix cache: not computed, not stacked
      data.push({ type: "scatter", mode: "markers", name: "prompt tokens served from cache (not computed)",
        x, y: s.a_cached.slice(), yaxis: "y", marker: { symbol: "circle-open", size: 9, color: "#4c78a8" },
        hovertext: text, hoverinfo: "text" });
    }
    const sampled = idx.filter((i) => s.a_sample[i] > 1);
    if (sampled.length) {
      data.push({ type: "scatter", mode: "markers", name: "sample of N steps (one log line)", yaxis: "y",
        x: sampled.map((i) => x[i]), y: sampled.map((i) => decode[i] || 0),
        marker: { symbol: "diamond", size: 8, color: "#222" },
        hovertext: sampled.map((i) => `sample of ${s.a_sample[i]} steps<br>${text[i]}`), hoverinfo: "text" });
    }
    if (s.budget.some((b) => b)) {
      data.push({ type: "scatter", mode: "markers", name: "budget (where logged)", x, yaxis: "y",
        y: s.budget.map((b) => b || null), marker: { symbol: "line-ew-open", size: 14, color: "#222" }, hoverinfo: "skip" });
    }
    const panels = [["y", "tokens / requests"]];
    if (known(s.a_usage)) {
      data.push(line("KV usage %", x, s.a_usage.map((u) => (u === null || u === undefined ? null : 100 * u)), text, "#4c78a8", "y2"));
      panels.push(["y2", "KV usage %"]);
    }
    if (known(s.a_wait) || known(s.a_run)) {
      const ax = `y${panels.length + 1}`;
      data.push(line("waiting", x, s.a_wait.slice(), text, "#ff7f0e", ax), line("running", x, s.a_run.slice(), text, "#2ca02c", ax));
      panels.push([ax, "queue (requests)"]);
    }
    if (known(s.a_tps)) {
      const ax = `y${panels.length + 1}`;
      data.push(line("gen tokens/s (logged)", x, s.a_tps.slice(), text, "#9467bd", ax));
      panels.push([ax, "gen tokens/s"]);
    }
    const layout = { height: 260 + 140 * panels.length, barmode: "stack", hovermode: "closest",
      margin: { l: 60, r: 20, t: 40, b: 40 }, uirevision: "aggregate-" + axis.mode,
      legend: { orientation: "h", y: 1.02, yanchor: "bottom", x: 0, xanchor: "left" },
      xaxis: { title: { text: style.x_titles[axis.mode] }, anchor: panels[panels.length - 1][0] } };
    // the panels top to bottom: the batch twice the height of each other one
    const weights = panels.map((_, k) => (k ? 1 : 2)), sum = weights.reduce((a, b) => a + b, 0);
    const gap = 0.04, usable = 1 - gap * (panels.length - 1);
    let top = 1;
    panels.forEach(([ax, title], k) => {
      const h = (usable * weights[k]) / sum;
      const name = ax === "y" ? "yaxis" : `yaxis${ax.slice(1)}`;
      layout[name] = { title: { text: title }, domain: [Math.max(0, top - h), top] };
      if (ax !== "y") layout[name].anchor = "x";
      top -= h + gap;
    });
    if (!n) layout.annotations = [{ text: "No steps from the source yet.", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }];
    return { data, layout };
  }

  // Each tensor-parallel rank's forward time per step (solid) and its all-reduce share (dotted):
  // a rank whose line sits above the others is a straggler every other rank waits for.
  function ranksFigure(rec, axis, style) {
    const s = rec.steps, byRank = new Map();
    const x = [];
    for (let i = 0; i < s.length; i++) {
      const ranks = s.ranks[i];
      if (!ranks) continue;
      const k = x.length;
      x.push(axis.mode === "time" ? s.t1[i] : s.step[i]);
      for (const [rank, fwd, comm] of ranks) {
        if (!byRank.has(rank)) byRank.set(rank, { fwd: [], comm: [] });
        const r = byRank.get(rank);
        while (r.fwd.length < k) { r.fwd.push(null); r.comm.push(null); }
        r.fwd.push(fwd); r.comm.push(comm);
      }
    }
    const data = [];
    for (const rank of [...byRank.keys()].sort((a, b) => a - b)) {
      const r = byRank.get(rank), color = RANK_COLORS[rank % RANK_COLORS.length];
      data.push({ type: "scatter", mode: "lines", name: `rank ${rank} forward`, x, y: r.fwd,
        line: { color, width: 1.5 }, hovertemplate: `rank ${rank}: %{y:.2f} ms forward<extra></extra>` });
      if (known(r.comm)) {
        data.push({ type: "scatter", mode: "lines", name: `rank ${rank} all-reduce`, x, y: r.comm,
          line: { color, width: 1, dash: "dot" }, hovertemplate: `rank ${rank}: %{y:.2f} ms all-reduce<extra></extra>` });
      }
    }
    return { data, layout: { height: 300, hovermode: "x unified", uirevision: "ranks-" + axis.mode,
      margin: { l: 60, r: 20, t: 40, b: 40 }, legend: { orientation: "h", y: 1.02, yanchor: "bottom", x: 0, xanchor: "left" },
      xaxis: { title: { text: style.x_titles[axis.mode] } }, yaxis: { title: { text: "ms" }, rangemode: "tozero" } } };
  }

  // the rank with the largest mean forward time (the straggler, if there is one)
  function slowestRank(rec) {
    const sums = new Map();
    for (const ranks of rec.steps.ranks) for (const [rank, fwd] of ranks || []) {
      if (fwd === null || fwd === undefined) continue;
      const t = sums.get(rank) || [0, 0];
      sums.set(rank, [t[0] + fwd, t[1] + 1]);
    }
    let best = null;
    for (const [rank, [sum, count]] of sums) if (best === null || sum / count > best[1]) best = [rank, sum / count];
    return best && best[0];
  }

  S.aggregateFigure = aggregateFigure;
  S.ranksFigure = ranksFigure;
  S.slowestRank = slowestRank;
})(window.stepscope = window.stepscope || {});
