// The st.components.v2 entry point. Streamlit re-sends it with every update, so it is tiny: it
// loads plotly.js and the charts' files (static files, see app/live/component.py) once per page
// and hands every update to them. `a`: the asset URLs (sent with a reset), `w.__ss`: the load.
// The charts' files load in parallel and run in order (async = false): data.js first.
// A load that failed (a busy server, a dropped connection) is forgotten, so the next update
// that carries the URLs loads again: a page must not stay without charts for good.
export default function (c) {
const w = window, a = (c.data || {}).assets;
const load = (s) => new Promise((ok, no) => { const e = document.createElement("script");
e.src = new URL(s, document.baseURI).href; e.async = false; e.onload = ok;
e.onerror = () => { e.remove(); no(new Error(s)); }; document.head.appendChild(e); });
if (!w.__ss && a) {
const ss = w.__ss = (w.Plotly ? Promise.resolve() : load(a.plotly)).then(() => Promise.all(a.scripts.map(load)));
ss.catch((err) => { console.warn("stepscope: " + err.message + " did not load; loading again with the next update"); if (w.__ss === ss) w.__ss = null; });
}
let on = true;
if (w.__ss) w.__ss.then(() => on && w.stepscopeLive.render(c), () => {});
return () => { on = false; if (w.stepscopeLive) w.stepscopeLive.unmount(c.parentElement); };
}
