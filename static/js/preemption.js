// Session page: the preemption notice (issue 32.2). While the session is under notice (RUNNING
// with `preempt_at`) a banner says so with a live countdown to its stop, the signal it was sent
// and whether it is launched again; once preempted it links the session it was requeued as (and
// a requeued session the one it was launched again for). Follows the session's state from
// terminal.js ("fgpu:session"); ticks once a second while a countdown shows. No build step.
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

  function tick() {
    var left = (Date.parse(session.preempt_at) - Date.now()) / 1000;
    $("preempt-countdown").textContent = left > 0 ? clock(left) : "now";
    $("preempt-countdown").setAttribute("datetime", session.preempt_at);
    $("preempt-headline-text").textContent = left > 0 ? "This session will be preempted in" : "This session is being preempted";
    if (left <= 0 && timer) { clearInterval(timer); timer = null; }
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

  document.addEventListener("fgpu:session", function (ev) {
    session = ev.detail;
    render();
  });
  render();
})();
