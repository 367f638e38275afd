// Session page: the notices of an end the user did not ask for. Preemption (issue 32.2): while the
// session is under notice (RUNNING with `preempt_at`) a banner says so with a live countdown to
// its stop, the signal it was sent and whether it is launched again; once preempted it links the
// session it was requeued as (and a requeued session the one it was launched again for).
// Reclamation (issue 36.3): warned of idleness or of its maximum lifetime, a banner counts down
// to its `deadline` and says what, if anything, averts it; the deadline is the session's own
// field where the API gives it, else its usage history's (GET …/usage/?since=now: `deadline`,
// `deadline_reason`), read when the page opens, at each notice and every 15 s while it runs.
// Follows the session's state from terminal.js ("fgpu:session"); ticks once a second while a
// countdown shows. No build step.
(function () {
  "use strict";

  var $ = function (id) { return document.getElementById(id); };
  var box = $("preempt-notice");
  if (!box) return;
  var session = JSON.parse($("session-data").textContent);
  var timer = null;

  function two(n) { return (n < 10 ? "0" : "") + n; }

  // Seconds → "4:05" (or "1:02:03"): what the countdown shows.
  function clock(seconds) {
    var s = Math.max(0, Math.ceil(seconds));
    var h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
    return (h ? h + ":" + two(m) : String(m)) + ":" + two(s % 60);
  }

  function link(id, text) {
    var a = document.createElement("a");
    a.href = "/sessions/" + encodeURIComponent(id) + "/terminal/";
    a.textContent = text;
    return a;
  }

  function left(iso) { return (Date.parse(iso) - Date.now()) / 1000; }

  function tick() {
    var s = left(session.preempt_at);
    $("preempt-countdown").textContent = s > 0 ? clock(s) : "now";
    $("preempt-countdown").setAttribute("datetime", session.preempt_at);
    $("preempt-headline-text").textContent = s > 0 ? "This session will be preempted in" : "This session is being preempted";
    if (s <= 0 && timer) { clearInterval(timer); timer = null; }
  }

  function render() {
    var noticed = session.status === "RUNNING" && !!session.preempt_at;
    var after = session.requeued_as || session.requeued_from;
    box.hidden = !noticed && !after;
    box.setAttribute("data-kind", noticed ? "notice" : "requeued");
    $("preempt-headline").hidden = !noticed;
    $("preempt-detail").hidden = !noticed;
    if (timer && !noticed) { clearInterval(timer); timer = null; }
    if (noticed) {
      var at = new Date(session.preempt_at);
      $("preempt-signal").textContent = session.preempt_signal || "SIGTERM";
      $("preempt-stop").textContent = at.toLocaleTimeString();
      $("preempt-reason").textContent = session.status_reason ? "Reason: " + session.status_reason : "";
      $("preempt-requeue").textContent = session.requeue === false
        ? "It will not be launched again (its launch said requeue: false)."
        : "It is then launched again as a new session with the same request, command and image, keeping its place in the queue.";
      tick();
      if (!timer) timer = setInterval(tick, 1000);
    }
    var links = $("preempt-links");
    links.textContent = "";
    if (session.requeued_as) {
      links.append("Preempted and launched again as ", link(session.requeued_as, "a new session"), ".");
    } else if (session.requeued_from) {
      links.append("Launched again for ", link(session.requeued_from, "a preempted session"),
        "; it kept that session's place in the queue.");
    }
    links.hidden = !session.requeued_as && !session.requeued_from;
  }

  // ---- Reclamation: idle or at its maximum lifetime --------------------------------------

  var reclaim = $("reclaim-notice");
  var warning = { deadline: null, reason: "" };
  var reclaimTimer = null, polling = null, asking = false;
  var LIFETIME = /^reached its maximum lifetime/; // usage.services: the lifetime's reason

  function reclaimTick() {
    var s = left(warning.deadline);
    $("reclaim-countdown").textContent = s > 0 ? clock(s) : "now";
    $("reclaim-headline-text").textContent = s > 0 ? "This session will be terminated in" : "This session is being terminated";
    if (s <= 0 && reclaimTimer) { clearInterval(reclaimTimer); reclaimTimer = null; }
  }

  function renderReclaim() {
    var shown = session.status === "RUNNING" && !!warning.deadline;
    reclaim.hidden = !shown;
    if (!shown) {
      if (reclaimTimer) { clearInterval(reclaimTimer); reclaimTimer = null; }
      return;
    }
    var reason = warning.reason || "reclaimed by its resource group";
    var lifetime = LIFETIME.test(reason);
    reclaim.setAttribute("data-kind", lifetime ? "lifetime" : "idle");
    $("reclaim-countdown").setAttribute("datetime", warning.deadline);
    $("reclaim-reason").textContent = reason.charAt(0).toUpperCase() + reason.slice(1);
    $("reclaim-stop").textContent = new Date(warning.deadline).toLocaleTimeString();
    $("reclaim-advice").textContent = lifetime
      ? "Its resource group's maximum lifetime: nothing extends it. Save your work now."
      : "Use it to keep it: type in its terminal or run work on its GPU, and the warning is withdrawn.";
    reclaimTick();
    if (!reclaimTimer) reclaimTimer = setInterval(reclaimTick, 1000);
  }

  function askWarning() {
    if (!reclaim || asking || session.status !== "RUNNING" || !window.fgpu) return;
    if ("deadline" in session) { // the session's own fields: no need to ask
      warning = { deadline: session.deadline, reason: session.deadline_reason || "" };
      renderReclaim();
      return;
    }
    asking = true;
    var since = Math.floor(Date.now() / 1000) - 1;
    window.fgpu.api("GET", reclaim.getAttribute("data-url") + "?since=" + since).then(function (r) {
      asking = false;
      if (r.ok && r.data) { warning = { deadline: r.data.deadline, reason: r.data.deadline_reason }; renderReclaim(); }
    }).catch(function () { asking = false; }); // the next poll tries again; the banner keeps what it had
  }

  function followWarning() {
    askWarning();
    if (session.status === "RUNNING" && !polling) polling = setInterval(askWarning, 15000);
    if (session.status !== "RUNNING" && polling) { clearInterval(polling); polling = null; }
    renderReclaim();
  }

  document.addEventListener("fgpu:session", function (ev) {
    session = ev.detail;
    render();
    if (reclaim) followWarning(); // a warning, or its withdrawal, comes with a notice of the session
  });
  render();
  if (reclaim) followWarning();
})();
