// The KV page map: the engine's `kv_map` reply, one canvas cell per page (or per few pages).
(function (S) {
  "use strict";
  const { color } = S;

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
      S.injectStyle(); // view.js, loaded after this file
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

  S.PageMap = PageMap;
})(window.stepscope = window.stepscope || {});
