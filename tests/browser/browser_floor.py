"""The same browser's floor for the live charts' per-update time (tests/browser/test_browser_live.py
and `python -m bench.page_rate --update-cost --browser`): one Plotly.react of a 1,000-point
line, median of 20."""

FLOOR_JS = """() => {
    const gd = document.createElement('div');
    gd.style.width = '1400px';
    document.body.appendChild(gd);
    const out = [];
    for (let k = 0; k < 20; k++) {
        const x = [], y = [];
        for (let i = 0; i < 1000; i++) { x.push(i + k); y.push(Math.sin(i / 50 + k)); }
        const t = performance.now();
        Plotly.react(gd, [{type: 'scatter', x, y, mode: 'lines'}], {height: 400, uirevision: 1});
        out.push(performance.now() - t);
    }
    Plotly.purge(gd); gd.remove();
    out.sort((a, b) => a - b);
    return out[10];
}"""
