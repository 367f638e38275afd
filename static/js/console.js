// What the console's pages share: the API helper, the "sign in again" notice, the live
// /ws/sessions/ connection, and sessions' times and endings in words. Loaded before each
// page's own script (window.fgpu). No build step.
(function () {
  "use strict";

  var me = document.body.getAttribute("data-user") || "";

  function csrfToken() {
    var m = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    if (m) return decodeURIComponent(m[1]);
    var input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  // ---- Signed out: say so, with a link back to this very page --------------------------

  function loginUrl() {
    return "/login/?next=" + encodeURIComponent(location.pathname + location.search + location.hash);
  }

  var signedOutBox = null;
  function signedOut() {
    if (!signedOutBox) {
      signedOutBox = document.createElement("div");
      signedOutBox.id = "signed-out";
      signedOutBox.className = "alert alert-warning signed-out";
      signedOutBox.setAttribute("role", "alert");
      var text = document.createElement("span");
      text.textContent = "You are signed out (your sign-in ended or the server forgot it). ";
      var link = document.createElement("a");
      link.id = "sign-in-again";
      link.className = "button button-small button-primary";
      link.textContent = "Sign in again";
      signedOutBox.appendChild(text);
      signedOutBox.appendChild(link);
      var main = document.getElementById("main") || document.body;
      main.insertBefore(signedOutBox, main.firstChild);
    }
    signedOutBox.querySelector("a").href = loginUrl(); // the page's place as it is now
    signedOutBox.hidden = false;
  }

  function signedIn() {
    if (signedOutBox) signedOutBox.hidden = true;
  }

  // DRF answers 401 to an API call without valid credentials (403 "not-authenticated" when
  // only the browser's session cookie was tried).
  function isSignedOut(status, data) {
    var type = data && data.type;
    return status === 401 || (status === 403 && (type === "not-authenticated" || type === "authentication-failed"));
  }

  // fetch → {ok, status, data}; a 401 shows the "sign in again" notice as well.
  function api(method, url, body) {
    var init = {
      method: method,
      credentials: "same-origin",
      headers: { "Accept": "application/json", "X-CSRFToken": csrfToken() },
    };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    return fetch(url, init).then(function (resp) {
      return resp.text().then(function (text) {
        var data = null;
        try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
        var out = { ok: resp.ok, status: resp.status, data: data, signedOut: isSignedOut(resp.status, data) };
        if (out.signedOut) signedOut();
        return out;
      });
    });
  }

  function errorText(result) {
    if (result.signedOut) return "You are signed out: sign in again to go on.";
    if (result.data && result.data.detail) return String(result.data.detail);
    if (result.status === 403) return "You are not allowed to do that.";
    return "The server answered " + result.status + ". Try again.";
  }

  // ---- /ws/sessions/: session notices, reconnecting within 5 s once the server is back ----

  var CLOSE_UNAUTHENTICATED = 4401;
  var RETRY_MAX_MS = 2000; // with ±25 % jitter: a restarted server is seen again within 2.5 s, and the page
  // loaded again within its 5 s promise also when that load is slow (a server busy starting up)

  // handlers: onSession(session), onOpen(reopened: true after a gap), onDown().
  function watchSessions(handlers) {
    var retry = 0, timer = null, opened = false, socket = null;
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";

    function connect() {
      clearTimeout(timer);
      timer = null;
      var ws;
      try { ws = new WebSocket(scheme + location.host + "/ws/sessions/"); }
      catch (e) { later(); return; }
      socket = ws;
      ws.onopen = function () {
        retry = 0;
        signedIn();
        var reopened = opened;
        opened = true;
        if (handlers.onOpen) handlers.onOpen(reopened);
      };
      ws.onmessage = function (ev) {
        var msg;
        try { msg = JSON.parse(ev.data); } catch (e) { return; }
        if (msg && msg.type === "session" && msg.session && handlers.onSession) handlers.onSession(msg.session);
      };
      ws.onclose = function (ev) {
        if (socket === ws) socket = null;
        if (ev.code === CLOSE_UNAUTHENTICATED) signedOut();
        if (handlers.onDown) handlers.onDown(ev);
        later();
      };
    }

    function later() {
      if (timer) return;
      var delay = Math.min(RETRY_MAX_MS, 500 * Math.pow(2, retry)) * (0.75 + Math.random() * 0.5);
      retry = Math.min(retry + 1, 6);
      timer = setTimeout(connect, delay);
    }

    // Back from sleep, a lost network or a hidden tab: try at once rather than at the next tick.
    function soon() { if (!socket && timer) connect(); }
    window.addEventListener("online", soon);
    document.addEventListener("visibilitychange", function () { if (!document.hidden) soon(); });
    connect();
  }

  // ---- Times -----------------------------------------------------------------------

  // Milliseconds → "45s", "3m 04s", "2h 05m", "3d 4h".
  function duration(ms) {
    var s = Math.max(0, Math.floor(ms / 1000));
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + pad(s % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + pad(Math.floor(s / 60) % 60) + "m";
    return Math.floor(s / 86400) + "d " + Math.floor(s / 3600) % 24 + "h";
  }

  function time(value) {
    var t = value ? new Date(value).getTime() : NaN;
    return isNaN(t) ? null : t;
  }

  var FINAL = ["TERMINATED", "ERROR", "CANCELLED"];
  var ORDER = ["PENDING", "SCHEDULED", "PREPARING", "RUNNING", "TERMINATING"];

  // Whether the session state `s` is older than `shown`, the one on the page: two states can
  // arrive out of order (notices from the web and the manager, an API answer read before a
  // notice). Each write raises the session's `version`, so the higher one is newer; without
  // versions (an old server), an ended state beats a live one and statuses go forward only.
  function isStale(s, shown) {
    if (!shown) return false;
    if (typeof s.version === "number" && typeof shown.version === "number") return s.version < shown.version;
    if (FINAL.indexOf(shown.status) !== -1) return FINAL.indexOf(s.status) === -1;
    var a = ORDER.indexOf(s.status), b = ORDER.indexOf(shown.status);
    return FINAL.indexOf(s.status) === -1 && a !== -1 && b !== -1 && a < b;
  }

  // How long the session has been (or was) at it: {text, live}. Running: since it started;
  // waiting or starting: since it was created; ended: how long it ran, if it ever did.
  function elapsed(s, now) {
    var created = time(s.created_at), started = time(s.started_at), ended = time(s.terminated_at);
    now = now || Date.now();
    if (FINAL.indexOf(s.status) !== -1) {
      if (started !== null) return { text: "ran " + duration((ended || now) - started), live: false };
      return { text: "never started", live: false };
    }
    if (started !== null) return { text: duration(now - started), live: true };
    if (created === null) return { text: "—", live: false };
    return { text: (s.status === "PENDING" ? "waiting " : "starting ") + duration(now - created), live: true };
  }

  // ---- How a session ended, in words ------------------------------------------------

  var SIGNALS = { 1: "SIGHUP", 2: "SIGINT", 3: "SIGQUIT", 4: "SIGILL", 5: "SIGTRAP", 6: "SIGABRT", 7: "SIGBUS",
                  8: "SIGFPE", 9: "SIGKILL", 10: "SIGUSR1", 11: "SIGSEGV", 12: "SIGUSR2", 13: "SIGPIPE",
                  14: "SIGALRM", 15: "SIGTERM", 24: "SIGXCPU", 25: "SIGXFSZ" };

  // An exit status as shells report it: 128+N is "killed by signal N".
  function exitCodeText(code) {
    if (code > 128 && code <= 128 + 64) {
      var n = code - 128;
      return "killed by signal " + n + (SIGNALS[n] ? " (" + SIGNALS[n] + ")" : "");
    }
    return "exited with code " + code;
  }

  var REQUESTED = /^(?:terminat(?:ing|ed) )?at the request of (.+)$/; // sessions.lifecycle.services.REQUESTED
  var EXITED = /^the process exited with code (\d+)$/; // the agent's words for a process that ended by itself

  // Why a session ended or is ending, for people: "terminated by you", "exited with code 3",
  // "killed by signal 9 (SIGKILL)", else the server's own reason. "" when there is nothing to add.
  function endReason(s) {
    var reason = String(s.status_reason || "");
    var asked = reason.match(REQUESTED);
    if (asked) {
      var mine = asked[1] === me;
      if (s.status === "TERMINATING") {
        return mine ? "terminating at your request" : "terminating at the request of " + asked[1];
      }
      return "terminated by " + (mine ? "you" : asked[1]);
    }
    var exited = reason.match(EXITED);
    if (exited) return exitCodeText(Number(exited[1]));
    if (reason && reason.toLowerCase() !== String(s.status).toLowerCase()) return reason;
    if (s.exit_code !== null && s.exit_code !== undefined) return exitCodeText(s.exit_code);
    if (s.status === "TERMINATED") return "terminated";
    return "";
  }

  window.fgpu = {
    me: me, api: api, errorText: errorText, csrfToken: csrfToken, signedOut: signedOut, isSignedOut: isSignedOut,
    watchSessions: watchSessions, duration: duration, elapsed: elapsed, endReason: endReason,
    exitCodeText: exitCodeText, FINAL: FINAL, isStale: isStale,
  };
})();
