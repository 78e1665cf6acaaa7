// stepscope's charts view: batches of new steps (app/live/encode.py) appended in the browser and
// drawn with plotly.js in place, so zoom, pan and hover survive every update. The charts
// themselves are in timeline.js, kv.js and progress.js; the data in data.js.
//
// The page pulls: after drawing a batch, the view reports the batch's id through the
// component's state (`pull`), which reruns the charts' fragment on the server, whose answer is
// the next batch (held there until the engine's next step). A batch that does not extend what
// the view holds (`base` differs) is ignored and the view asks again from where it is.
// A `static` view (a recording drawn whole, for compare) gets one batch and never pulls; its
// `axes` fix the x range and the batch chart's height, and views of one `link` group zoom
// together. Everything the charts show was decided in Python; this file only keeps the columns
// (the last `window` steps) and lays them out.
(function (S) {
  "use strict";
  const { Record, Axis, timelineFigure, kvFigure, progressFigure, itlFigure } = S;
  const views = new Map(); // parentElement -> its view
  const groups = new Map(); // link group -> the views that zoom together

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
      items.push(swatch("waiting", `background:${style.wait}`), swatch("stall (no token)", `background:${style.stall}`),
        `<span><b style="color:${style.stall};margin-right:5px">✕</b>retracted: the pool ran out of pages</span>`,
        swatch("retracted, waiting to be recomputed", "background:repeating-linear-gradient(45deg, #444 0 3px, #fff 3px 4px)"));
    } else if (view === "kv") {
      for (const k of ["used", "cached", "free"]) items.push(swatch(`${k} pages`, `background:${style.kv[k]}`));
      items.push(swatch("reserved (promised or estimated, not yet computed)", "border:none;border-top:2px dotted #222;height:0;vertical-align:3px"),
        swatch("pool full (nothing free or evictable)", `border:none;width:0;height:0;border-left:6px solid transparent;border-right:6px solid transparent;border-top:10px solid ${style.stall}`));
    } else if (view === "latency") {
      items.push(swatch("inter-token latency", "background:#555;border-radius:50%"),
        swatch("after a stall (steps ran without the request)", `background:${style.stall};border-radius:50%`));
    } else {
      items.push(swatch("tokens generated, all requests", "border:none;border-top:3px solid #222;height:0;vertical-align:3px"),
        swatch("each request (its colour)", `border:none;border-top:2px solid ${style.palette[0]};height:0;vertical-align:3px`),
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
      this.emptyAnswers = 0; // answers in a row that brought nothing new
      this.updates = 0;
      this.lastPull = 0;
      this.timer = null;
      this.watchdog = null;
      this.inflight = false;
      this.view = "timeline";
      this.revision = 0; // a new history (cleared, a new engine) starts a new zoom state
      this.history = undefined; // the history of the steps drawn (a reset batch names it)
      this.mount = Math.random().toString(36).slice(2); // tells this view's pulls from an earlier one's
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
          <button data-view="latency">Inter-token latency</button>
          <label class="sl-whole"><input type="checkbox"> whole pool</label>
          <span class="sl-status"></span>
        </div>
        <div class="sl-caption"></div>
        <div class="sl-legend"></div>
        <div class="sl-plot sl-timeline"></div>
        <div class="sl-plot sl-kv" style="display:none"></div>
        <div class="sl-plot sl-progress" style="display:none"></div>
        <div class="sl-plot sl-latency" style="display:none"></div>`;
      el.appendChild(root);
      this.root = root;
      this.plots = { timeline: root.querySelector(".sl-timeline"), kv: root.querySelector(".sl-kv"),
        progress: root.querySelector(".sl-progress"), latency: root.querySelector(".sl-latency") };
      this.title = document.createElement("div");
      this.title.className = "sl-title";
      root.prepend(this.title);
      this.status = root.querySelector(".sl-status");
      this.caption = root.querySelector(".sl-caption");
      this.legend = root.querySelector(".sl-legend");
      this.whole = root.querySelector(".sl-whole input");
      this.whole.onchange = () => this.draw();
      root.querySelectorAll("button[data-view]").forEach((b) => {
        b.onclick = () => { this.select(b.dataset.view); this.draw(); };
      });
      injectStyle();
    }

    receive(component) {
      this.setStateValue = component.setStateValue;
      const data = component.data || {};
      if (data.style) this.style = data.style;
      this.paused = !!data.paused;
      this.xmode = data.xmode || this.xmode || "step";
      // a narrower window (the sidebar's Steps in view) applies at once, even to an idle engine
      const windowSteps = data.window || this.windowSteps || 500;
      const narrower = this.windowSteps !== undefined && windowSteps < this.windowSteps;
      this.windowSteps = windowSteps;
      if (narrower) this.rec.trim(windowSteps);
      if (data.engine) this.engine = data.engine;
      if (data.captions) this.captions = data.captions;
      this.root.style.display = data.hidden ? "none" : "";
      if (data.static) {
        this.static = true;
        this.axes = data.axes || null;
        this.title.textContent = data.title || "";
        if (data.link && this.link !== data.link) {
          this.link = data.link;
          if (!groups.has(data.link)) groups.set(data.link, new Set());
          groups.get(data.link).add(this);
        }
        if (data.id === this.id && data.xmode === this.drawnX) return; // a rerun: the same data
      }
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
        // another history (Clear history, a new engine, another source) is not where the user
        // had zoomed: the charts autorange to it, and so they do when a reset of the same
        // history left nothing in the zoomed range
        if (applied && data.reset) {
          if (data.history !== this.history || this.zoomMissesData()) this.revision++;
          this.history = data.history;
        }
        if (applied) {
          this.emptyAnswers = 0;
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
      } else if (this.drawnX !== undefined && (narrower || this.xmode !== this.drawnX || this.paused !== this.drawnPaused)) {
        this.draw(); // the same steps, seen differently (a full run's answer may name an older batch)
      }
      this.answered(data);
      // mounted afresh while paused (the pause banner moves the charts down the page): this
      // view holds nothing, and a paused view does not pull; it asks once for the frozen view
      if (this.paused && !this.static && this.id === null && !this.inflight) { this.pull(true); return; }
      // new data we could not use (it extends what we do not hold): right away, from here.
      // Nothing new: again at once (the server holds a pull until the engine's next step), or,
      // once a few holds in a row found nothing (an idle engine), after idle_ms: an idle page's
      // pulls cost the browser its redraws of the page for nothing
      const stale = data.steps && !applied;
      this.emptyAnswers = stale ? 0 : this.emptyAnswers + 1;
      const idle = this.emptyAnswers >= (this.style ? this.style.idle_after : 3);
      this.nextPull(idle ? (this.style ? this.style.idle_ms : 500) : 0);
    }

    answered(data) {
      const ours = data.answer_m === undefined || data.answer_m === this.mount;
      if (data.answer !== undefined && data.answer === this.pulls && ours) {
        if (this.inflight) { // the round trip through Streamlit, for the benchmark
          performance.measure("stepscope-pull", { start: this.lastPull, end: performance.now() });
        }
        this.inflight = false; // the answer to our last pull (Streamlit may repeat it: harmless)
        clearTimeout(this.watchdog);
      }
    }

    nextPull(extraDelay) {
      if (!this.paused && !this.static && !this.inflight && this.timer === null) this.schedulePull(extraDelay);
    }

    schedulePull(extraDelay) {
      if (!this.setStateValue) return;
      const every = this.style ? this.style.pull_ms : 200;
      const wait = Math.max(0, every - (performance.now() - this.lastPull)) + extraDelay;
      if (wait <= 0) { this.pull(); return; }
      this.timer = setTimeout(() => { this.timer = null; this.pull(); }, wait);
    }

    // `frozen`: a paused view that holds nothing asks for the frozen view (once, until answered)
    pull(frozen) {
      if ((this.paused && !frozen) || this.static || !this.setStateValue) return;
      this.lastPull = performance.now();
      this.pulls++;
      this.inflight = true;
      this.setStateValue("pull", { have: this.id, n: this.pulls, m: this.mount });
      // an answer that never comes (a rerun cut short by another) must not stop the charts
      clearTimeout(this.watchdog);
      this.watchdog = setTimeout(() => {
        this.inflight = false;
        this.pull(this.paused && this.id === null);
      }, 3000);
    }

    // whether the timeline is zoomed to where no step held is (after a reset)
    zoomMissesData() {
      const gd = this.plots.timeline, full = gd._fullLayout && gd._fullLayout.xaxis;
      if (!full || full.autorange !== false || gd._stepscopeX !== this.xmode || !this.rec.steps.length) return false;
      const [i0, i1] = new Axis(this.rec, this.xmode).window(full.range);
      return i1 <= i0;
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
        const zoomed = full && gd._stepscopeX === this.xmode && gd._stepscopeRev === this.revision && full.autorange === false;
        const range = zoomed ? full.range.slice() : null;
        // fixed axes (compare): the common range first, then wherever the user (or the
        // linked view) zoomed: a react with the fixed range again would undo the zoom
        let fixed = this.axes && this.axes[this.xmode];
        if (fixed && range) fixed = Object.assign({}, fixed, { x: range });
        fig = timelineFigure(this.rec, axis, this.style, range, gd.clientWidth || this.el.clientWidth || 1200, fixed);
        fig.layout.uirevision = "timeline-" + this.xmode + "-" + this.revision;
        gd._stepscopeX = this.xmode;
        this.lod = fig.detail ? "segments" : "totals";
        this.root.dataset.lanes = fig.lanes.join("/"); // lanes drawn / requests held
      } else if (this.view === "kv") {
        const full = gd._fullLayout && gd._fullLayout.xaxis;
        const zoomed = full && gd._stepscopeX === this.xmode && gd._stepscopeRev === this.revision && full.autorange === false;
        fig = kvFigure(this.rec, axis, this.style, this.engine.page_size || 1, this.whole.checked,
          zoomed ? full.range.slice() : null, gd.clientWidth || this.el.clientWidth || 1200);
        gd._stepscopeX = this.xmode;
      } else if (this.view === "latency") {
        fig = itlFigure(this.rec, axis, this.style, gd.clientWidth || this.el.clientWidth || 1200);
      } else {
        fig = progressFigure(this.rec, this.style, gd.clientWidth || this.el.clientWidth || 1200);
        this.root.dataset.lines = fig.lines; // per-request lines drawn
      }
      if (this.view !== "timeline") fig.layout.uirevision += "-" + this.revision;
      gd._stepscopeRev = this.revision;
      steadyTicks(fig.layout);
      // an empty trace costs Plotly its defaults and styling all the same (the legend is ours)
      const data = fig.data.filter((tr) => !Array.isArray(tr.x) || tr.x.length > 0);
      const t = performance.now();
      window.Plotly.react(gd, data, fig.layout, { displaylogo: false, scrollZoom: false, responsive: true });
      performance.measure("stepscope-plot", { start: t, end: performance.now() });
      if (!gd._stepscopeHooked && gd.on) {
        // zooming or panning changes what is in view (and its level of detail): redraw then
        // too, so a paused page is still drawn in full wherever the user looks
        gd._stepscopeHooked = true;
        const view = this.view;
        gd.on("plotly_relayout", (ev) => {
          cancelAnimationFrame(this.raf);
          this.raf = requestAnimationFrame(() => this.draw());
          this.zoomPartners(view, ev);
        });
      }
      const legend = legendHtml(this.view, this.view === "timeline" ? this.lod : "", this.style);
      if (legend !== this.legendShown) { this.legend.innerHTML = legend; this.legendShown = legend; }
      const n = this.rec.steps.length;
      const last = n ? this.rec.steps.step[n - 1] : null;
      this.status.textContent = n
        ? `${n} steps held (last #${last})` + (this.view === "timeline" ? ` · ${fig.nView} in view · ${this.lod === "segments" ? "per-request segments" : "per-step totals (zoom in for requests)"}` : "") + (this.static ? " · the whole recording" : this.paused ? " · paused" : "")
        : this.static ? "This recording has no steps." : "No engine steps recorded yet: submit a prompt.";
      Object.assign(this.root.dataset, { updates: this.updates, steps: n, lod: this.lod || "", last: last === null ? "" : last });
    }

    select(view) {
      this.view = view;
      this.root.querySelectorAll("button[data-view]").forEach((x) => x.classList.toggle("sl-on", x.dataset.view === view));
      for (const [k, p] of Object.entries(this.plots)) p.style.display = k === view ? "" : "none";
    }

    // views of one link group (compare's A and B) zoom and pan together on the x axis
    zoomPartners(view, ev) {
      if (!this.link || this.syncing || !ev) return;
      const x = {};
      for (const [k, v] of Object.entries(ev)) if (k.startsWith("xaxis.")) x[k] = v;
      if (!Object.keys(x).length) return;
      for (const other of groups.get(this.link) || []) {
        if (other === this || !other.root.isConnected) continue;
        other.syncing = true;
        Promise.resolve(window.Plotly.relayout(other.plots[view], x)).finally(() => { other.syncing = false; });
      }
    }

    destroy() {
      if (this.link && groups.has(this.link)) groups.get(this.link).delete(this);
      clearTimeout(this.timer);
      clearTimeout(this.watchdog);
      for (const p of Object.values(this.plots)) if (window.Plotly) window.Plotly.purge(p);
    }
  }

  // Tick labels measured on every draw were 40% of Plotly's time per live update: each
  // label's box is read to pick an angle and to hide labels past the div, and every read
  // forces a layout of the whole Streamlit page. Level labels that may overflow need neither.
  function steadyTicks(layout) {
    for (const [key, ax] of Object.entries(layout)) {
      if (!/^[xy]axis\d*$/.test(key) || !ax) continue;
      if (ax.tickangle === undefined) ax.tickangle = 0;
      if (ax.ticklabeloverflow === undefined) ax.ticklabeloverflow = "allow";
    }
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
      .stepscope-live .sl-title { font-weight:600; font-size:15px; margin:4px 0; }
      .stepscope-live .sl-title:empty { display:none; }
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
        view = mode === "kvmap" ? new S.PageMap(el) : mode === "sweep" ? new S.SweepPlot(el) : new LiveView(el);
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
  };
  S.injectStyle = injectStyle;
})(window.stepscope = window.stepscope || {});
