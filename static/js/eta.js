// Session page: the "When will I start?" panel of a PENDING session (issue 17.3). Asks
// GET /api/v1/sessions/<id>/eta/ when the page opens, whenever the session's own state changes
// (terminal.js sends "fgpu:session") and every POLL_S seconds while it waits (other people's
// sessions starting and ending move its estimate); hides itself once the session leaves PENDING.
// Needs console.js (window.fgpu). No build step.
(function () {
  "use strict";

  var fgpu = window.fgpu;
  var $ = function (id) { return document.getElementById(id); };
  var panel = $("eta-panel");
  if (!panel || !fgpu) return;
  var session = JSON.parse($("session-data").textContent);
  var POLL_S = 15;
  var answer = null;      // the last estimate
  var timer = null;
  var inFlight = false;

  function clock(ms) {
    var d = new Date(ms), now = new Date();
    var hm = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", hour12: false }); // as the charts' axes
    if (d.toDateString() === now.toDateString()) return hm;
    return d.toLocaleDateString([], { weekday: "short", day: "numeric", month: "short" }) + " " + hm;
  }

  function span(ms) { // "12 min", "1 h 5 min", "2 d 3 h"
    var m = Math.max(0, Math.round(ms / 60000));
    if (m < 1) return "less than a minute";
    if (m < 60) return m + " min";
    var h = Math.floor(m / 60);
    if (h < 24) return h + " h" + (m % 60 ? " " + (m % 60) + " min" : "");
    return Math.floor(h / 24) + " d" + (h % 24 ? " " + (h % 24) + " h" : "");
  }

  // "now" only for a session that fits now; one that waits for ends due now starts "any moment"
  // (sessions.scheduling.eta.band_agreed; the CLI says the same)
  var soon = "now";
  function relative(ms) { return ms <= Date.now() + 30000 ? soon : "in " + span(ms - Date.now()); }

  function band(earliest, latest) { // [clock text, relative text]
    var a = earliest ? new Date(earliest).getTime() : null;
    var b = latest ? new Date(latest).getTime() : null;
    if (a === null) return ["—", ""];
    if (b === null) return ["from " + clock(a), relative(a) + " at the earliest"];
    if (clock(a) === clock(b)) return ["at " + clock(a), relative(a)];
    var rb = relative(b);
    return [clock(a) + " – " + clock(b), relative(a) + " to " + (rb === soon ? soon : rb.slice(3))];
  }

  function item(parts) {
    var li = document.createElement("li");
    parts.forEach(function (p) {
      var el = document.createElement(p[0]);
      if (p[2]) el.className = p[2];
      el.textContent = p[1];
      li.appendChild(el);
    });
    return li;
  }

  function render() {
    if (!answer) return;
    var a = answer, text = "", when = "", explain = a.reason || "";
    soon = a.fits_now ? "now" : "any moment";
    if (a.outcome === "now") {
      text = "It fits now: it starts at the next scheduler pass";
    } else if (a.outcome === "estimate") {
      var b = band(a.earliest, a.latest);
      text = "Expected to start " + b[0];
      when = b[1];
    } else if (a.outcome === "never") {
      text = "It can never start as asked";
    } else {
      text = "No estimate";
      explain = explain.replace(/^no estimate: /, ""); // said once, as the answer (issue 36.3)
    }
    $("eta-answer").textContent = text;
    $("eta-answer").setAttribute("data-outcome", a.outcome);
    $("eta-when").textContent = when;
    $("eta-when").hidden = !when;
    $("eta-explain").textContent = explain.charAt(0).toUpperCase() + explain.slice(1);
    $("eta-explain").hidden = !explain;
    var smaller = (a.mig_now || []).map(function (o) { return o.profile + " (" + (o.memory / 1073741824).toFixed(1) + " GiB)"; });
    $("eta-mig-now").textContent = smaller.length ? "A smaller MIG instance is free now: " + smaller.join(", ") : "";
    $("eta-mig-now").hidden = !smaller.length;
    $("eta-position").textContent = a.position ? "#" + a.position : "—";
    $("eta-fits").textContent = a.fits_now ? "yes (it waits its turn)" : "no";

    var after = $("eta-after");
    after.textContent = "";
    (a.fits_after || []).forEach(function (r) {
      var b = band(r.ends_earliest, r.ends_latest);
      var who = r.name ? r.name + (r.owner ? " (" + r.owner + ")" : "") : "a session of another user";
      after.appendChild(item([["span", who, "eta-who"], ["span", "on " + r.node, "eta-where muted"],
        ["span", r.ends_earliest ? "ends " + b[0] + (b[1] ? " · " + b[1] : "") : "no known end", "eta-end"],
        ["span", r.basis, "eta-basis muted"]]));
    });
    $("eta-after-section").hidden = !(a.fits_after || []).length;

    var nodes = $("eta-nodes");
    nodes.textContent = "";
    var reason = (a.waiting_reason || "").replace(/^waiting for capacity: /, "");
    var parts = reason ? reason.split("; ") : [];
    parts.forEach(function (p) {
      var m = /^([^:]+): (.*)$/.exec(p);
      nodes.appendChild(m ? item([["span", m[1], "eta-node"], ["span", m[2], "eta-why"]]) : item([["span", p, "eta-why"]]));
    });
    $("eta-nodes-section").hidden = !parts.length;
    $("eta-note").textContent = "Estimated at " + new Date(a.computed_at).toLocaleTimeString([], { hour12: false }) +
      " · updates every " + POLL_S + " s";
  }

  function load() {
    if (inFlight || session.status !== "PENDING") return;
    inFlight = true;
    fgpu.api("GET", panel.getAttribute("data-url")).then(function (r) {
      inFlight = false;
      if (r.ok && r.data) { answer = r.data; render(); return; }
      if (r.status === 409) { stop(); return; } // it left PENDING meanwhile: the status notice follows
      $("eta-note").textContent = "Could not estimate: " + fgpu.errorText(r);
    }).catch(function () {
      inFlight = false;
      $("eta-note").textContent = answer ? "Could not reach the server; showing the last estimate" :
        "Could not reach the server";
    });
  }

  function start() {
    panel.hidden = false;
    load();
    if (!timer) timer = setInterval(load, POLL_S * 1000);
  }

  function stop() {
    panel.hidden = true;
    clearInterval(timer);
    timer = null;
  }

  document.addEventListener("fgpu:session", function (ev) {
    var s = ev.detail, changed = s.status_reason !== session.status_reason || s.status !== session.status;
    session = s;
    if (s.status !== "PENDING") { stop(); return; }
    if (changed || !timer) start();
  });
  setInterval(render, 30000); // "in 12 min" moves on between estimates
  if (session.status === "PENDING") start();
})();
