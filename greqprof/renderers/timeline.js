/* greqprof profile page: summary, timeline (one row per greenlet), blocking
 * events, waiting time and the function table.  Plain DOM, no network.
 * Every string from the profile is put on the page with textContent (never
 * innerHTML), so nothing in a request path or a function name can become
 * markup. */
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("gq-data").textContent);
  var app = document.getElementById("gq-app");

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }
  function add(parent, child) { parent.appendChild(child); return child; }
  function ms(sec) {
    if (sec === null || sec === undefined) { return "-"; }
    var v = sec * 1000;
    var a = Math.abs(v);
    if (a >= 100) { return v.toFixed(0) + " ms"; }
    if (a >= 10) { return v.toFixed(1) + " ms"; }
    if (a >= 1) { return v.toFixed(2) + " ms"; }
    return v.toFixed(3) + " ms";
  }
  function pct(part, whole) {
    return whole > 0 ? Math.min(100, Math.max(0, part / whole * 100)) : 0;
  }
  /* a time on the page's axis, said relative to the request's start */
  function at(t) {
    var d = t - (data.request ? data.request[0] : 0);
    return d < 0 ? ms(-d) + " before the request started" : "+" + ms(d) + " after the start";
  }
  /* file paths without the interpreter/site-packages prefix (full path in
   * the cell's tooltip) */
  function shortPath(p) {
    var m = /^.*(?:site-packages|dist-packages|lib\/python\d+(?:\.\d+)?)\/(.*)$/.exec(p || "");
    if (m) { return m[1]; }
    var parts = (p || "").split("/");
    return parts.length > 3 && p.length > 40 ? "\u2026/" + parts.slice(-2).join("/") : (p || "");
  }
  function fnLabel(f) { return f.module ? f.module + "." + f.qualname : f.qualname; }
  function siteLabel(i) {
    var w = data.waits[i];
    return w.fn + " (" + shortPath(w.file) + ":" + w.line + ")";
  }
  /* indexes of the wait sites whose waits overlap [t0, t1], longest
   * overlap first */
  function sitesDuring(t0, t1) {
    var by = {};
    (data.wait_events || []).forEach(function (e) {
      var o = Math.min(t1, e[2]) - Math.max(t0, e[1]);
      if (o > 0) { by[e[3]] = (by[e[3]] || 0) + o; }
    });
    return Object.keys(by).map(Number).sort(function (a, b) {
      return by[b] - by[a] || a - b;
    });
  }

  var S = data.summary;
  var dur = data.duration > 0 ? data.duration : 1e-6;

  /* ---------------------------------------------------------- header --- */
  var h1 = add(app, el("h1"));
  if (data.kind === "request") {
    add(h1, el("span", "gq-method", S.method));
    add(h1, document.createTextNode(" "));
    add(h1, el("span", "gq-path", S.path));
  } else {
    add(h1, el("span", "gq-path", data.title));
  }
  var meta = [];
  if (S.status) { meta.push("status " + S.status); }
  if (S.start_utc) { meta.push(S.start_utc); }
  if (S.pid) { meta.push("pid " + S.pid + (S.hostname ? " on " + S.hostname : "")); }
  if (S.request_id) { meta.push("request id " + S.request_id); }
  if (S.sampled_by && data.kind === "request") { meta.push("sampled by " + S.sampled_by); }
  add(app, el("p", "gq-note", meta.join(" \u00b7 ")));
  if (S.error) { add(app, el("p", "gq-error", "Error: " + S.error)); }

  var cards = add(app, el("div", "gq-cards"));
  function card(k, v, bad) {
    var c = add(cards, el("div", "gq-card" + (bad ? " gq-bad" : "")));
    add(c, el("div", "gq-k", k));
    add(c, el("div", "gq-v", v));
  }
  card(data.kind === "request" ? "Wall" : "Time span",
       ms(data.kind === "request" ? data.request[1] - data.request[0] : data.duration));
  card("CPU", ms(S.cpu));
  if (data.kind === "request") {
    card("Waiting", ms(S.waiting) + (S.waiting_complete ? "" : "+"));
  }
  card("Spans", String(S.spans) + (S.dropped_spans ? " (" + S.dropped_spans + " dropped)" : ""));
  card("Greenlets", String(data.rows.length));
  card("Blocking", String(S.blocking), S.blocking > 0);
  if (data.calls) { card("Functions", String(data.calls.length)); }

  /* -------------------------------------------------------- timeline --- */
  add(app, el("h2", null, "Timeline"));
  var bar = add(app, el("div", "gq-toolbar"));
  var zoom = 1;
  var zin = add(bar, el("button", null, "Zoom in"));
  var zout = add(bar, el("button", null, "Zoom out"));
  var zfit = add(bar, el("button", null, "Fit"));
  zin.type = zout.type = zfit.type = "button";
  var legend = add(bar, el("div", "gq-legend"));
  function leg(cls, text) {
    var s = add(legend, el("span"));
    add(s, el("span", "gq-sw " + cls));
    add(s, document.createTextNode(text));
  }
  if (data.kind === "request") { leg("gq-sw-req", "request open"); }
  leg("gq-sw-span", data.kind === "request" ? "span: a greenlet of the request ran"
                                            : "span: a greenlet ran");
  if (data.kind === "request") {
    leg("gq-sw-wait", "waiting: none of them ran (other greenlets / I/O)");
    if ((data.wait_events || []).length) {
      leg("gq-sw-waitsite", "a greenlet waited (hover: where)");
    }
  }
  leg("gq-sw-block", "blocking span (held the event loop)");
  if (data.dropped_wait_events) {
    add(app, el("p", "gq-note", data.dropped_wait_events +
      " more waits are not drawn (the profile keeps the first 1024 one by one; " +
      "the table below counts them all)."));
  }
  if (data.truncated_spans) {
    add(app, el("p", "gq-note", data.truncated_spans +
      " more spans are not drawn (the page draws at most " + data.spans.length + ")."));
  }

  var tl = add(app, el("div", "gq-tl"));
  var labels = add(tl, el("div", "gq-labels"));
  var scroll = add(tl, el("div", "gq-scroll"));
  var canvas = add(scroll, el("div", "gq-canvas"));
  add(labels, el("div", "gq-label gq-axis-label", "time since start"));
  var axis = add(canvas, el("div", "gq-axis"));

  function place(node, t0, t1) {
    node.style.left = pct(t0, dur) + "%";
    node.style.width = pct(t1 - t0, dur) + "%";
  }

  if (data.kind === "request") {
    var lab = add(labels, el("div", "gq-label gq-label-request"));
    add(lab, el("span", "gq-gname", "request"));
    add(lab, el("span", "gq-fn", S.method + " " + S.path));
    lab.title = S.method + " " + S.path;
    var rrow = add(canvas, el("div", "gq-row gq-row-request"));
    var rb = add(rrow, el("div", "gq-req"));
    place(rb, data.request[0], data.request[1]);
    rb.title = "request open " + ms(data.request[1] - data.request[0]);
    data.waiting.forEach(function (w) {
      var wb = add(rrow, el("div", "gq-wait"));
      place(wb, w[0], w[1]);
      /* where the request's greenlets were waiting meanwhile */
      var at = sitesDuring(w[0], w[1]);
      wb.title = "waiting " + ms(w[1] - w[0]) + (at.length ? "\nat " +
        at.map(siteLabel).join("\nat ") : "");
      if (at.length) {
        wb.setAttribute("data-sites", at.join(" "));
        add(wb, el("span", "gq-wait-at", data.waits[at[0]].fn));
      }
    });
  }

  var rowEls = [];
  data.rows.forEach(function (r) {
    var lab = add(labels, el("div", "gq-label gq-label-greenlet"));
    add(lab, el("span", "gq-gname", r.name || ("greenlet " + r.gid)));
    add(lab, el("span", "gq-fn", r.fn));
    lab.title = "greenlet " + r.gid + " " + r.name + " " + r.fn +
      "\nCPU " + ms(r.cpu) + ", ran " + ms(r.wall) + ", " + r.switches +
      " switches" + (r.finished ? ", finished" : "");
    var row = add(canvas, el("div", "gq-row gq-row-greenlet"));
    row.setAttribute("data-gid", String(r.gid));
    rowEls.push(row);
  });

  /* each greenlet's waits, on its row, with the site it waited at */
  (data.wait_events || []).forEach(function (e) {
    var b = add(rowEls[e[0]], el("div", "gq-waitsite"));
    place(b, e[1], e[2]);
    b.setAttribute("data-site", String(e[3]));
    b.title = "waited " + ms(e[2] - e[1]) + " at " + siteLabel(e[3]);
  });

  var spanEls = [];
  data.spans.forEach(function (s, i) {
    var b = el("div", "gq-span" + (s.b ? " gq-blocking" : ""));
    b.setAttribute("data-i", String(i));
    place(b, s.t0, s.t1);
    rowEls[s.r].appendChild(b);
    spanEls.push(b);
  });

  function niceStep(raw) {
    var p = Math.pow(10, Math.floor(Math.log(raw) / Math.LN10));
    var m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }
  function drawAxis() {
    while (axis.firstChild) { axis.removeChild(axis.firstChild); }
    var px = canvas.getBoundingClientRect().width || 800;
    var step = niceStep(dur / Math.max(1, Math.floor(px / 90)));
    var decimals = Math.max(0, -Math.floor(Math.log(step * 1000) / Math.LN10 + 1e-9));
    for (var k = 0; k * step <= dur + 1e-12; k++) {
      var t = k * step;
      var tick = add(axis, el("div", "gq-tick", (t * 1000).toFixed(decimals) + " ms"));
      tick.style.left = pct(t, dur) + "%";
    }
  }
  function setZoom(z) {
    zoom = Math.max(1, Math.min(z, 4096));
    canvas.style.width = (zoom * 100) + "%";
    drawAxis();
  }
  zin.addEventListener("click", function () { setZoom(zoom * 2); });
  zout.addEventListener("click", function () { setZoom(zoom / 2); });
  zfit.addEventListener("click", function () { setZoom(1); });
  window.addEventListener("resize", drawAxis);
  setZoom(1);

  /* tooltip + details */
  var tip = add(document.body, el("div", "gq-tip"));
  function spanSummary(s) {
    var r = data.rows[s.r];
    return (s.b ? "BLOCKING span\n" : "") + (r.name || "greenlet") + " (" + r.gid + ") " + r.fn +
      "\n" + at(s.t0) + ", ran " + ms(s.t1 - s.t0) + ", CPU " + ms(s.cpu) +
      (s.f ? "\ngreenlet finished" : "");
  }
  canvas.addEventListener("mousemove", function (ev) {
    var t = ev.target;
    if (!t.classList || !t.classList.contains("gq-span")) { tip.style.display = "none"; return; }
    tip.textContent = spanSummary(data.spans[+t.getAttribute("data-i")]) +
      "\n(click for details and stack)";
    tip.style.display = "block";
    var x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    tip.style.left = Math.max(4, x) + "px";
    tip.style.top = (ev.clientY + 16) + "px";
  });
  canvas.addEventListener("mouseleave", function () { tip.style.display = "none"; });

  var details = add(app, el("div", "gq-details"));
  details.setAttribute("aria-live", "polite");
  add(details, el("span", "gq-note", "Hover a span for a summary; click it for details and its stack."));
  var selected = null;
  function kv(dl, k, v) { add(dl, el("dt", null, k)); add(dl, el("dd", null, v)); }
  function showSpan(i) {
    var s = data.spans[i];
    var r = data.rows[s.r];
    if (selected) { selected.classList.remove("gq-selected"); }
    selected = spanEls[i];
    selected.classList.add("gq-selected");
    while (details.firstChild) { details.removeChild(details.firstChild); }
    add(details, el("strong", s.b ? "gq-error" : null, s.b ? "Blocking span" : "Span"));
    var dl = add(details, el("dl"));
    kv(dl, "greenlet", r.gid + " " + r.name);
    kv(dl, "function", r.fn || "-");
    kv(dl, "start", at(s.t0));
    kv(dl, "ran for", ms(s.t1 - s.t0));
    kv(dl, "CPU", ms(s.cpu));
    kv(dl, "ended with", s.f ? "the greenlet finishing" : "a switch to another greenlet");
    if (s.s >= 0) {
      add(details, el("div", "gq-note", "Where the greenlet switched out:"));
      add(details, el("pre", "gq-stack", data.stacks[s.s]));
    } else {
      add(details, el("div", "gq-note", "No stack captured (only long spans get one)."));
    }
  }
  canvas.addEventListener("click", function (ev) {
    var t = ev.target;
    if (t.classList && t.classList.contains("gq-span")) { showSpan(+t.getAttribute("data-i")); }
  });

  /* ------------------------------------------------- blocking, waiting --- */
  if (data.blocking.length) {
    add(app, el("h2", null, "Blocking events (" + data.blocking.length + ")"));
    data.blocking.forEach(function (b) {
      var box = add(app, el("div", "gq-details gq-blocking-event"));
      add(box, el("strong", "gq-error", "Held the event loop for " + ms(b.wall) +
        " (CPU " + ms(b.cpu) + "), " + at(b.t0)));
      add(box, el("div", null, "greenlet " + b.gid + " " + b.name + " " + b.fn));
      if (b.sampled_stack) {
        add(box, el("div", "gq-note", "Running while the loop was held (watchdog):"));
        add(box, el("pre", "gq-stack", b.sampled_stack));
      }
      if (b.stack) {
        add(box, el("div", "gq-note", "Where it switched out:"));
        add(box, el("pre", "gq-stack", b.stack));
      }
    });
  }
  if (data.kind === "request" && (data.waits || []).length) {
    add(app, el("h2", null, "Where the request waited (" + data.waits.length + " sites)"));
    add(app, el("p", "gq-note", "Time from each switch-out of the request's greenlets " +
      "until they ran again, by the code they switched out in. Click a row for its stack." +
      (data.dropped_waits ? " " + data.dropped_waits +
       " waits at further sites were not recorded (table full)." : "")));
    var st = add(app, el("table", "gq-table gq-waits"));
    var sh = add(add(st, el("thead")), el("tr"));
    add(sh, el("th", "gq-num", "waited"));
    add(sh, el("th", "gq-num", "waits"));
    add(sh, el("th", "gq-num", "greenlets"));
    add(sh, el("th", null, "function"));
    add(sh, el("th", null, "location"));
    var sb = add(st, el("tbody"));
    data.waits.forEach(function (w, i) {
      var tr = add(sb, el("tr", "gq-fn-row gq-wait-row"));
      tr.setAttribute("data-site", String(i));
      add(tr, el("td", "gq-num", ms(w.seconds)));
      add(tr, el("td", "gq-num", String(w.count)));
      add(tr, el("td", "gq-num", String(w.greenlets)));
      add(tr, el("td", "gq-mono", w.fn));
      var loc = add(tr, el("td", "gq-loc", shortPath(w.file) + ":" + w.line));
      loc.title = w.file + ":" + w.line;
      var sub = null;
      tr.addEventListener("click", function () {
        if (sub) { sb.removeChild(sub); sub = null; return; }
        sub = el("tr", "gq-callees gq-wait-stack");
        var td = add(sub, el("td"));
        td.colSpan = 5;
        add(td, el("pre", "gq-stack", w.stack.join("\n")));
        sb.insertBefore(sub, tr.nextSibling);
      });
    });
  }
  if (data.kind === "request" && data.waiting_top.length) {
    add(app, el("h2", null, "While the request waited, these greenlets ran"));
    var wt = add(app, el("table", "gq-table"));
    var wh = add(add(wt, el("thead")), el("tr"));
    add(wh, el("th", "gq-num", "time"));
    add(wh, el("th", null, "greenlet"));
    add(wh, el("th", null, "function"));
    var wb = add(wt, el("tbody"));
    data.waiting_top.forEach(function (w) {
      var tr = add(wb, el("tr"));
      add(tr, el("td", "gq-num", ms(w.seconds)));
      add(tr, el("td", null, w.gid + " " + w.name));
      add(tr, el("td", "gq-mono", w.fn));
    });
  }

  /* -------------------------------------------------- function table --- */
  add(app, el("h2", null, "Functions"));
  if (!data.calls) {
    add(app, el("p", "gq-note",
      "No function statistics: profile with calls=True (serve --calls) to get them."));
    return;
  }
  add(app, el("p", "gq-note", "Times are " + data.clock + " time. Click a header to sort, " +
    "a row to see its callees." + (S.dropped_calls ? " " + S.dropped_calls +
    " calls were dropped (table full)." : "")));
  var filter = add(app, el("input", "gq-filter"));
  filter.type = "search";
  filter.placeholder = "filter functions";
  filter.setAttribute("aria-label", "filter functions");
  var cols = [
    {key: "fn", title: "function", num: false, get: function (f) { return fnLabel(f).toLowerCase(); }},
    {key: "ncall", title: "calls", num: true, get: function (f) { return f.ncall; }},
    {key: "tsub", title: "exclusive", num: true, get: function (f) { return f.tsub; }},
    {key: "ttot", title: "inclusive", num: true, get: function (f) { return f.ttot; }},
    {key: "avg", title: "incl. per call", num: true, get: function (f) { return f.ncall ? f.ttot / f.ncall : 0; }},
    {key: "loc", title: "location", num: false, get: function (f) { return (f.file + ":" + f.line).toLowerCase(); }}
  ];
  var table = add(app, el("table", "gq-table gq-functions"));
  var htr = add(add(table, el("thead")), el("tr"));
  var tbody = add(table, el("tbody"));
  var sortKey = "ttot", sortDesc = true;
  var ths = cols.map(function (c) {
    var th = add(htr, el("th", "gq-sortable" + (c.num ? " gq-num" : ""), c.title));
    th.setAttribute("data-key", c.key);
    th.tabIndex = 0;
    function go() {
      if (sortKey === c.key) { sortDesc = !sortDesc; } else { sortKey = c.key; sortDesc = c.num; }
      drawTable();
    }
    th.addEventListener("click", go);
    th.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); go(); }
    });
    return th;
  });
  var open = {};
  function drawTable() {
    var col = cols.filter(function (c) { return c.key === sortKey; })[0];
    var q = filter.value.toLowerCase();
    var rows = data.calls.map(function (f, i) { return i; }).filter(function (i) {
      return !q || fnLabel(data.calls[i]).toLowerCase().indexOf(q) >= 0 ||
        data.calls[i].file.toLowerCase().indexOf(q) >= 0;
    });
    rows.sort(function (a, b) {
      var x = col.get(data.calls[a]), y = col.get(data.calls[b]);
      var c = x < y ? -1 : x > y ? 1 : 0;
      return (sortDesc ? -c : c) || a - b;
    });
    ths.forEach(function (th, i) {
      var c = cols[i];
      th.textContent = c.title + (c.key === sortKey ? (sortDesc ? " \u25bc" : " \u25b2") : "");
      th.setAttribute("aria-sort", c.key === sortKey ? (sortDesc ? "descending" : "ascending") : "none");
    });
    while (tbody.firstChild) { tbody.removeChild(tbody.firstChild); }
    rows.forEach(function (i) {
      var f = data.calls[i];
      var tr = add(tbody, el("tr", "gq-fn-row"));
      tr.setAttribute("data-index", String(i));
      add(tr, el("td", "gq-mono", fnLabel(f)));
      add(tr, el("td", "gq-num", f.ncall === f.prim ? String(f.ncall) : f.ncall + "/" + f.prim));
      add(tr, el("td", "gq-num", ms(f.tsub)));
      add(tr, el("td", "gq-num", ms(f.ttot)));
      add(tr, el("td", "gq-num", ms(f.ncall ? f.ttot / f.ncall : 0)));
      var loc = add(tr, el("td", "gq-loc", shortPath(f.file) + ":" + f.line));
      loc.title = f.file + ":" + f.line;
      tr.addEventListener("click", function () { open[i] = !open[i]; drawTable(); });
      if (open[i]) {
        var sub = add(tbody, el("tr", "gq-callees"));
        var td = add(sub, el("td"));
        td.colSpan = cols.length;
        if (!f.children.length) {
          td.textContent = "calls no profiled function";
        } else {
          add(td, el("div", "gq-note", "callees (calls, inclusive time of those calls):"));
          f.children.forEach(function (c) {
            add(td, el("div", "gq-mono", "\u2192 " + c.name + "   " + c.ncall + " calls, " + ms(c.ttot)));
          });
        }
      }
    });
  }
  filter.addEventListener("input", drawTable);
  drawTable();
})();
