// The st.components.v2 entry point. Streamlit re-sends it with every update, so it is tiny: it
// loads plotly.js and the charts' files (static files, see app/live/component.py) once per page
// and hands every update to them. `a`: the asset URLs (sent with a reset); `w.__ss`: resolves
// once they have loaded. The charts' files load in parallel and run in order (async = false).
// A load that fails (a busy server, a dropped connection) is tried again a second later, by
// itself: an idle page may get no further update to start it, and must not stay without charts.
export default function (c) {
const w = window, a = (c.data || {}).assets;
if (!w.__ss) w.__ss = new Promise((ok) => { w.__ssOk = ok; });
const load = (s) => new Promise((ok, no) => { const e = document.createElement("script");
e.src = new URL(s, document.baseURI).href; e.async = false; e.onload = ok;
e.onerror = () => { e.remove(); no(new Error(s)); }; document.head.appendChild(e); });
const attempt = (u) => (w.Plotly ? Promise.resolve() : load(u.plotly)).then(() => Promise.all(u.scripts.map(load)))
.then(() => w.__ssOk(), (err) => { console.warn("stepscope: " + err.message + " did not load; loading again in 1 s"); setTimeout(() => attempt(u), 1000); });
if (a && !w.__ssLoading) { w.__ssLoading = true; attempt(a); }
let on = true;
w.__ss.then(() => on && w.stepscopeLive.render(c));
return () => { on = false; if (w.stepscopeLive) w.stepscopeLive.unmount(c.parentElement); };
}
