// The st.components.v2 entry point, kept tiny because Streamlit re-sends it with every update:
// it loads plotly.js and the charts' code once per page (both served as static files, see
// app/live/component.py) and hands every update to them.
export default function (component) {
  const w = window;
  const assets = (component.data || {}).assets || {};
  const load = (src) =>
    new Promise((resolve, reject) => {
      const el = document.createElement("script");
      el.src = new URL(src, document.baseURI).href;
      el.onload = resolve;
      el.onerror = () => reject(new Error("cannot load " + src));
      document.head.appendChild(el);
    });
  if (!w.__stepscopeReady && assets.plotly && assets.live) {
    w.__stepscopeReady = (w.Plotly ? Promise.resolve() : load(assets.plotly)).then(() =>
      load(assets.live),
    );
  }
  let alive = true;
  if (w.__stepscopeReady) {
    w.__stepscopeReady.then(() => alive && w.stepscopeLive.render(component));
  }
  return () => {
    alive = false;
    if (w.stepscopeLive) w.stepscopeLive.unmount(component.parentElement);
  };
}
