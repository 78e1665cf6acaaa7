// A sweep's trade-off plot: one point per run (a policy at a token budget), TTFT p50 on x and a
// tail metric the user picks on y, one line per policy through its budgets. Pooled ITL p99 hides
// stalls (a policy can have the lowest ITL p99 and the longest stall), so worst stall is the
// default. The numbers are the sweep's rows (instrumentation.sweep, from the shared fold's
// summary); a click on a point reports its run file through the component's state (`selected`).
(function (S) {
  "use strict";

  // [key in the rows, button label, axis title]
  const METRICS = [
    ["worst_stall_s", "Worst stall", "worst stall (s)"],
    ["itl_p999_s", "ITL p99.9", "ITL p99.9 (s)"],
    ["itl_p99_s", "ITL p99", "ITL p99 (s)"],
  ];

  class SweepPlot {
    constructor(el) {
      this.el = el;
      this.metric = METRICS[0][0];
      this.clicks = 0;
      const root = document.createElement("div");
      root.className = "stepscope-live stepscope-sweep";
      root.innerHTML = `<div class="sl-bar" role="tablist"><span class="sl-whole">y axis:</span>`
        + METRICS.map(([k, label]) => `<button data-metric="${k}">${label}</button>`).join("")
        + `<span class="sl-status"></span></div><div class="sl-caption"></div><div class="sl-plot sl-sweep"></div>`;
      el.appendChild(root);
      this.root = root;
      this.plot = root.querySelector(".sl-sweep");
      this.status = root.querySelector(".sl-status");
      root.querySelectorAll("button[data-metric]").forEach((b) => {
        b.onclick = () => { this.metric = b.dataset.metric; this.draw(); };
      });
      S.injectStyle();
    }

    receive(component) {
      this.setStateValue = component.setStateValue;
      const data = component.data || {};
      if (data.style) this.style = data.style;
      this.rows = data.rows || [];
      this.title = data.title || "";
      if (data.caption) this.root.querySelector(".sl-caption").innerHTML = data.caption;
      if (data.metric && !this.picked) { this.metric = data.metric; this.picked = true; }
      this.draw();
    }

    draw() {
      if (!window.Plotly || !this.style) return;
      const [key, , title] = METRICS.find((m) => m[0] === this.metric);
      this.root.querySelectorAll("button[data-metric]").forEach((b) => b.classList.toggle("sl-on", b.dataset.metric === key));
      const known = this.rows.map((r) => r[key]).filter((v) => v !== null && v > 0);
      // a run without the metric (no stall at all) sits on the floor, as an open marker
      const floor = known.length ? Math.min(...known) / 3 : 1e-3;
      const data = [];
      const policies = [...new Set(this.rows.map((r) => r.policy))].sort();
      for (const policy of policies) {
        const pts = this.rows.filter((r) => r.policy === policy && r.ttft_p50_s).sort((a, b) => a.budget - b.budget);
        const colour = (this.style.policy_colors || {})[policy] || "#555";
        data.push({
          type: "scatter", mode: "lines+markers+text", name: policy,
          x: pts.map((r) => r.ttft_p50_s), y: pts.map((r) => (r[key] > 0 ? r[key] : floor)),
          text: pts.map((r) => String(r.budget)), textposition: "top center",
          marker: { size: 11, color: colour, symbol: pts.map((r) => (r[key] > 0 ? "circle" : "circle-open")) },
          line: { color: colour },
          customdata: pts.map((r) => [r.run, r.policy, r.budget, r[key] > 0 ? `${r[key].toFixed(3)} s` : "none"]),
          hovertemplate: `%{customdata[1]}, budget %{customdata[2]}<br>TTFT p50 %{x:.3f} s<br>${title.replace(" (s)", "")} %{customdata[3]}<br>click: open this run<extra></extra>`,
        });
      }
      const layout = {
        title: { text: this.title }, height: 520, hovermode: "closest", uirevision: "sweep-" + key,
        margin: { l: 70, r: 30, t: 60, b: 60 }, legend: { title: { text: "policy" } },
        xaxis: { title: { text: "TTFT p50 (s)" }, type: "log" },
        yaxis: { title: { text: title }, type: "log" },
      };
      window.Plotly.react(this.plot, data, layout, { displaylogo: false, responsive: true });
      if (!this.plot._stepscopeHooked && this.plot.on) {
        this.plot._stepscopeHooked = true;
        this.plot.on("plotly_click", (ev) => {
          const pt = ev && ev.points && ev.points[0];
          if (!pt || !pt.customdata || !this.setStateValue) return;
          this.clicks++;
          this.setStateValue("selected", { run: pt.customdata[0], n: this.clicks });
        });
      }
      this.status.textContent = `${this.rows.length} runs · y: ${title}`;
      Object.assign(this.root.dataset, { metric: key, runs: this.rows.length });
    }

    destroy() { if (window.Plotly) window.Plotly.purge(this.plot); }
  }

  S.SweepPlot = SweepPlot;
  S.SWEEP_METRICS = METRICS;
})(window.stepscope = window.stepscope || {});
