// Terminal page: xterm.js over the session's terminal websocket (one-time ticket per connection),
// plus live status of the session from /ws/sessions/. No build step.
(function () {
  "use strict";

  var FINAL = ["TERMINATED", "ERROR", "CANCELLED"];
  var $ = function (id) { return document.getElementById(id); };
  var session = JSON.parse($("session-data").textContent);
  var shell = document.querySelector(".terminal-shell");
  var statusLine = $("terminal-status");
  var banner = $("terminal-banner");
  var bannerText = $("terminal-banner-text");
  var reconnectButton = $("terminal-reconnect");
  var backLink = $("terminal-back");
  var wsScheme = location.protocol === "https:" ? "wss://" : "ws://";

  var socket = null;      // terminal websocket
  var exited = false;     // the server sent {"type": "exit"}
  var connecting = false;
  var retries = 0; // automatic reconnections in a row (the wait doubles, up to 30 s)
  var retryTimer = null;

  function setStatus(state, text) {
    shell.setAttribute("data-state", state);
    statusLine.textContent = text;
  }

  function showBanner(text, opts) {
    opts = opts || {};
    bannerText.textContent = text;
    reconnectButton.hidden = !opts.reconnect;
    backLink.hidden = !opts.back;
    banner.setAttribute("data-kind", opts.kind || "info");
    banner.hidden = false;
  }

  function hideBanner() { banner.hidden = true; }

  function csrfToken() {
    var m = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    if (m) return decodeURIComponent(m[1]);
    var input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  if (typeof window.Terminal !== "function" || !window.FitAddon) {
    setStatus("closed", "The terminal library did not load.");
    return;
  }

  // ---- xterm -------------------------------------------------------------

  var term = new window.Terminal({
    cursorBlink: true,
    convertEol: false,
    scrollback: 5000,
    fontSize: 14,
    lineHeight: 1.15,
    fontFamily: 'ui-monospace, "SFMono-Regular", "JetBrains Mono", "Cascadia Mono", Menlo, Consolas, "DejaVu Sans Mono", monospace',
    theme: {
      background: "#0d1117", foreground: "#e6edf3", cursor: "#7ee787", cursorAccent: "#0d1117",
      selectionBackground: "#264f78",
      black: "#484f58", red: "#ff7b72", green: "#3fb950", yellow: "#d29922", blue: "#58a6ff",
      magenta: "#bc8cff", cyan: "#39c5cf", white: "#b1bac4",
      brightBlack: "#6e7681", brightRed: "#ffa198", brightGreen: "#56d364", brightYellow: "#e3b341",
      brightBlue: "#79c0ff", brightMagenta: "#d2a8ff", brightCyan: "#56d4dd", brightWhite: "#ffffff",
    },
  });
  var fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open($("terminal"));

  function send(frame) {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify(frame));
  }

  function sendSize() {
    $("terminal-size").textContent = term.cols + "×" + term.rows;
    send({ type: "resize", cols: term.cols, rows: term.rows });
  }

  var fitQueued = false;
  function refit() {
    if (fitQueued) return;
    fitQueued = true;
    requestAnimationFrame(function () {
      fitQueued = false;
      try { fit.fit(); } catch (e) { /* hidden or zero-sized */ }
    });
  }

  term.onResize(sendSize);
  term.onData(function (data) { send({ type: "input", data: data }); });
  window.addEventListener("resize", refit);
  if (window.ResizeObserver) new ResizeObserver(refit).observe($("terminal"));
  fit.fit();
  $("terminal-size").textContent = term.cols + "×" + term.rows;

  // ---- Terminal connection -----------------------------------------------

  function describeNotRunning(s) {
    if (FINAL.indexOf(s.status) !== -1) {
      var text = "Session ended";
      if (s.exit_code !== null && s.exit_code !== undefined) text += " (exit code " + s.exit_code + ")";
      else text += " (" + s.status + ")";
      return text;
    }
    if (s.status === "TERMINATING") return "Session is terminating";
    var waiting = "Session is " + s.status + ": the terminal opens when it is RUNNING";
    return s.status_reason ? waiting + " (" + s.status_reason + ")" : waiting;
  }

  function connect() {
    if (connecting || (socket && socket.readyState <= WebSocket.OPEN)) return;
    if (session.status !== "RUNNING") {
      var text = describeNotRunning(session);
      var final = FINAL.indexOf(session.status) !== -1;
      setStatus(final ? "ended" : "waiting", text);
      if (final) showBanner(text, { back: true, kind: "ended" });
      else if (session.status === "TERMINATING") showBanner(text, { back: true, kind: "ended" });
      else showBanner("Waiting for the session to start…", { kind: "waiting" });
      return;
    }
    connecting = true;
    exited = false;
    hideBanner();
    setStatus("connecting", "Connecting…");
    fetch("/api/v1/sessions/" + encodeURIComponent(session.id) + "/terminal-ticket/", {
      method: "POST",
      credentials: "same-origin",
      headers: { "Accept": "application/json", "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
      body: "{}",
    }).then(function (resp) {
      return resp.json().catch(function () { return {}; }).then(function (data) {
        if (!resp.ok) throw new Error(data.detail || ("the server answered " + resp.status));
        return data;
      });
    }).then(function (ticket) {
      var url = /^wss?:\/\//.test(ticket.url) ? ticket.url : wsScheme + location.host + ticket.url;
      openSocket(url);
    }).catch(function (err) {
      connecting = false;
      var text = "Could not open the terminal: " + err.message;
      setStatus("closed", text);
      showBanner(text, { reconnect: true, kind: "error" });
    });
  }

  function openSocket(url) {
    var ws = new WebSocket(url);
    socket = ws;
    ws.onopen = function () {
      connecting = false;
      retries = 0;
      setStatus("connected", "Connected");
      term.write("\x1b[?25h"); // show the cursor again after an earlier exit
      refit();
      sendSize();
      term.focus();
    };
    ws.onmessage = function (ev) {
      var msg;
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      if (msg.type === "output" && typeof msg.data === "string") {
        term.write(msg.data);
      } else if (msg.type === "exit") {
        exited = true;
        var text = "Session ended (exit code " + msg.code + ")";
        term.write("\r\n\x1b[2m[" + text.toLowerCase() + "]\x1b[0m\r\n\x1b[?25l"); // and hide the cursor
        setStatus("ended", text);
        showBanner(text, { back: true, kind: "ended" });
      }
    };
    ws.onclose = function (ev) {
      connecting = false;
      if (socket === ws) socket = null;
      if (exited) return;
      var text = "Connection closed";
      if (ev.code === 4401 || ev.code === 4403) text += " (ticket refused)";
      else if (ev.reason) text += " (" + ev.reason + ")";
      // 1013: the server could not reach its message broker; 1011 and 1006: the connection broke.
      // The session itself goes on: connect again by ourselves, waiting longer each time.
      if ((ev.code === 1013 || ev.code === 1011 || ev.code === 1006) && FINAL.indexOf(session.status) === -1) {
        var wait = Math.min(30, Math.pow(2, retries++));
        setStatus("connecting", text + "; reconnecting in " + wait + " s…");
        retryTimer = setTimeout(connect, wait * 1000);
        return;
      }
      setStatus("closed", text);
      showBanner(text, { reconnect: FINAL.indexOf(session.status) === -1, back: true, kind: "error" });
    };
  }

  reconnectButton.addEventListener("click", function () {
    clearTimeout(retryTimer);
    term.write("\r\n\x1b[2m[reconnecting…]\x1b[0m\r\n");
    connect();
  });

  // ---- Live session status -----------------------------------------------

  function applySession(s) {
    var was = session.status;
    session = s;
    var badge = $("session-status-badge");
    badge.textContent = s.status;
    badge.className = "badge status-" + String(s.status).toLowerCase();
    $("session-configuration").textContent = s.configuration || "—";
    $("session-node").textContent = s.node || "—";
    $("session-devices").textContent = (s.allocations || []).map(function (a) {
      return "GPU " + a.device_index + " · " + a.model_name;
    }).join(", ") || "—";

    if (s.status === "RUNNING" && was !== "RUNNING" && !exited) {
      connect();
    } else if (s.status !== "RUNNING" && !socket && !connecting && !exited) {
      connect(); // shows why there is no terminal
    }
  }

  var retry = 0;
  function watchSession() {
    var ws;
    try { ws = new WebSocket(wsScheme + location.host + "/ws/sessions/"); }
    catch (e) { return later(); }
    ws.onopen = function () { retry = 0; };
    ws.onmessage = function (ev) {
      var msg;
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      if (msg && msg.type === "session" && msg.session && msg.session.id === session.id) applySession(msg.session);
    };
    ws.onclose = later;
    function later() {
      var delay = Math.min(30000, 1000 * Math.pow(2, retry)) * (0.75 + Math.random() * 0.5);
      retry = Math.min(retry + 1, 6);
      setTimeout(watchSession, delay);
    }
  }

  watchSession();
  connect();
})();
