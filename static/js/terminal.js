// Session page: xterm.js over the session's terminal websocket (one-time ticket per connection),
// the session's live status from /ws/sessions/ (read again after every reconnection), how it
// ended in words, and Terminate. The page is laid out by the session's phase (#session-page
// data-phase: queued, starting, running, ended; css/session_page.css). The view follows the
// output to its end unless the user scrolls up (issue 36.2). A batch session's pane is a log of
// its output: keys typed there go nowhere, a line of input goes to the program from the form
// under it. An ended session's pane shows its log (GET …/logs/). Needs console.js (window.fgpu).
// No build step.
(function () {
  "use strict";

  var fgpu = window.fgpu;
  var FINAL = fgpu.FINAL;
  var ACTIVE = ["PENDING", "SCHEDULED", "PREPARING", "RUNNING"];
  var $ = function (id) { return document.getElementById(id); };
  var session = JSON.parse($("session-data").textContent);
  var sessionUrl = "/api/v1/sessions/" + encodeURIComponent(session.id) + "/";
  var shell = document.querySelector(".terminal-shell");
  var statusLine = $("terminal-status");
  var banner = $("terminal-banner");
  var bannerText = $("terminal-banner-text");
  var reconnectButton = $("terminal-reconnect");
  var backLink = $("terminal-back");
  var wsScheme = location.protocol === "https:" ? "wss://" : "ws://";
  var RETRY_MAX_S = 2; // the terminal reconnects within 2 s of the server being back (its 5 s promise: 3 s left for its reads)
  var page = $("session-page");
  var batch = !!session.command; // its pane is its command's output; input only through the form under it
  var WIDE = window.matchMedia("(min-width: 1101px)"); // css/session_page.css: the panels beside the terminal

  var socket = null;      // terminal websocket
  var exited = false;     // the server sent {"type": "exit"}
  var connecting = false;
  var retries = 0; // automatic reconnections in a row (the wait doubles, up to RETRY_MAX_S)
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

  // ---- The page's phase: what leads ---------------------------------------------------------

  function phaseOf(s) {
    if (FINAL.indexOf(s.status) !== -1) return "ended";
    if (s.status === "PENDING") return "queued";
    if (s.status === "SCHEDULED" || s.status === "PREPARING") return "starting";
    return "running"; // and TERMINATING
  }

  var usageOpened = false;
  function renderPhase() {
    var phase = phaseOf(session), was = page.getAttribute("data-phase");
    page.setAttribute("data-phase", phase);
    // The charts are open where they sit beside a live terminal (once, so a user's fold stays).
    if (!usageOpened && WIDE.matches && phase === "running") {
      $("usage-panel").open = true;
      usageOpened = true;
    }
    if (phase !== was && typeof refit === "function") refit();
    renderEnded();
  }

  function when(iso) {
    if (!iso) return "—";
    var d = new Date(iso);
    return d.toLocaleString([], { dateStyle: "medium", timeStyle: "medium", hour12: false });
  }

  // How it ended, leading an ended session's page: "Terminated by you", "Exited with code 3", …
  function renderEnded() {
    var box = $("session-ended");
    var ended = FINAL.indexOf(session.status) !== -1;
    box.hidden = !ended;
    if (!ended) return;
    var why = fgpu.endReason(session);
    $("session-ended-how").textContent = why ? why.charAt(0).toUpperCase() + why.slice(1) : session.status;
    $("session-ended-status").textContent = session.status;
    $("session-ended-code").textContent = session.exit_code === null || session.exit_code === undefined ? "—" : session.exit_code;
    $("session-ended-started").textContent = session.started_at ? when(session.started_at) : "never started";
    $("session-ended-at").textContent = when(session.terminated_at);
    box.setAttribute("data-outcome", session.status === "ERROR" || (session.exit_code || 0) !== 0 ? "error"
      : session.exit_code === 0 ? "ok" : "ended");
  }

  // ---- The session's state in the header: badge, reason, elapsed, Terminate ------------

  function renderHeader() {
    var badge = $("session-status-badge");
    badge.textContent = session.status;
    badge.className = "badge status-" + String(session.status).toLowerCase();
    var final = FINAL.indexOf(session.status) !== -1;
    var reason = final || session.status === "TERMINATING" ? fgpu.endReason(session)
      : session.status !== "RUNNING" ? session.status_reason || "" : "";  // a preemption notice: preemption.js's banner
    $("session-reason").textContent = reason;
    $("session-reason").hidden = !reason;
    $("session-configuration").textContent = session.configuration || "—";
    $("session-node").textContent = session.node || "—";
    $("session-folders").textContent = "local to node " + session.node + ": other nodes see other folders";  // agent.toml [storage]
    $("session-folders").title = session.data_folders_note || "";  // the whole sentence
    $("session-folders-item").hidden = !session.data_folders_note;
    $("session-devices").textContent = (session.allocations || []).map(function (a) {
      return "GPU " + a.device_index + " · " + a.model_name;
    }).join(", ") || "—";
    $("terminate-session").hidden = ACTIVE.indexOf(session.status) === -1;
    $("session-apps").hidden = session.status !== "RUNNING" || !(session.apps || []).length;  // apps end with it
    renderElapsed();
    renderPhase();
  }

  function renderElapsed() {
    var e = fgpu.elapsed(session);
    $("session-elapsed").textContent = e.text;
  }

  // ---- Terminate (the list's confirmation) ---------------------------------------------

  var terminateButton = $("terminate-session");
  var terminateDialog = $("terminate-dialog");
  terminateButton.addEventListener("click", function () {
    $("terminate-name").textContent = session.name;
    terminateDialog.returnValue = "";
    terminateDialog.showModal();
    $("terminate-cancel").focus();
  });
  terminateDialog.addEventListener("click", function (ev) { if (ev.target === terminateDialog) terminateDialog.close(); });
  terminateDialog.addEventListener("close", function () {
    if (terminateDialog.returnValue !== "confirm") return;
    terminateButton.disabled = true;
    terminateButton.textContent = "Terminating…";
    fgpu.api("DELETE", sessionUrl).then(function (r) {
      terminateButton.disabled = false;
      terminateButton.textContent = "Terminate";
      if (r.ok && r.data) { applySession(r.data); return; }
      showBanner("Could not terminate the session: " + fgpu.errorText(r), { kind: "error" });
    }).catch(function () {
      terminateButton.disabled = false;
      terminateButton.textContent = "Terminate";
      showBanner("Could not reach the server to terminate the session.", { kind: "error" });
    });
  });

  var refit = null; // set once xterm is there
  renderHeader();
  setInterval(renderElapsed, 1000);

  if (typeof window.Terminal !== "function" || !window.FitAddon) {
    setStatus("closed", "The terminal library did not load.");
    return;
  }

  // ---- xterm -------------------------------------------------------------

  var term = new window.Terminal({
    cursorBlink: !batch,
    convertEol: false,
    scrollback: 5000,
    disableStdin: batch, // a batch session's pane is a log: keys typed there go nowhere (its input: the form)
    fontSize: window.matchMedia("(max-width: 480px)").matches ? 12 : 14,
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

  // ---- Following the output to its end ----------------------------------------------------
  // xterm keeps its view where it is once the view is above the end, and a scroll event it did
  // not cause (a stale one from its own viewport while a flood of output is parsed, or a layout
  // change refitting it) can put it there: after `seq 1 200000` the view stayed at the top of
  // the scrollback (line 195,002) with no prompt. So the page decides: the view follows the
  // output unless the user scrolled up (wheel, touch, keys, the scrollbar; a click in the text is
  // none of them) and has not come back to the end; after each write and each refit it is put at
  // the end again.

  var follow = true;
  var userScrollUntil = 0; // ms: a scroll of the viewport before then is the user's
  var endQueued = false;
  var followButton = $("terminal-follow");
  function userScrolling() { userScrollUntil = Date.now() + 600; }
  function setFollow(on) {
    follow = on;
    followButton.hidden = on;
    if (on) term.scrollToBottom();
  }
  function keepAtEnd() { if (follow) term.scrollToBottom(); }
  var termBox = $("terminal");
  termBox.addEventListener("wheel", userScrolling, { passive: true, capture: true });
  termBox.addEventListener("touchmove", userScrolling, { passive: true, capture: true });
  termBox.addEventListener("pointerdown", function (ev) { // on the scrollbar (the viewport), not a click in the text
    if (ev.target && ev.target.classList && ev.target.classList.contains("xterm-viewport")) userScrolling();
  }, { passive: true, capture: true });
  termBox.addEventListener("keydown", function (ev) {
    if (ev.key === "PageUp" || ev.key === "PageDown" || ev.key === "Home" || ev.key === "End") userScrolling();
  }, true);
  var viewport = termBox.querySelector(".xterm-viewport");
  if (viewport) {
    viewport.addEventListener("scroll", function () {
      if (Date.now() > userScrollUntil) { // not the user's: back to the end (a stale event after the last write too)
        if (follow && !endQueued) { endQueued = true; requestAnimationFrame(function () { endQueued = false; keepAtEnd(); }); }
        return;
      }
      var b = term.buffer.active;
      setFollow(b.viewportY >= b.baseY);
    });
  }
  followButton.addEventListener("click", function () { setFollow(true); term.focus(); });
  term.onData(function () { if (!follow) setFollow(true); }); // typing brings the view back to the prompt

  function sendSize() {
    $("terminal-size").textContent = term.cols + "×" + term.rows;
    send({ type: "resize", cols: term.cols, rows: term.rows });
  }

  var fitQueued = false;
  refit = function () {
    if (fitQueued) return;
    fitQueued = true;
    requestAnimationFrame(function () {
      fitQueued = false;
      // Narrow screens: the pane fills the screen below what is above it (css/session_page.css).
      shell.style.setProperty("--shell-top", Math.max(0, shell.getBoundingClientRect().top + window.scrollY) + "px");
      try { fit.fit(); } catch (e) { /* hidden or zero-sized */ }
      keepAtEnd();
    });
  };

  term.onResize(sendSize);
  if (!batch) term.onData(function (data) { send({ type: "input", data: data }); });

  // A batch session's input: a line (and Enter) to the program's standard input, or its end.
  var inputForm = $("terminal-input");
  if (inputForm) {
    inputForm.addEventListener("submit", function (ev) {
      ev.preventDefault();
      var line = $("terminal-input-line");
      send({ type: "input", data: line.value + "\r" });
      line.value = "";
      setFollow(true);
    });
    $("terminal-input-eof").addEventListener("click", function () { send({ type: "input", data: "\x04" }); });
  }
  window.addEventListener("resize", refit);
  if (window.ResizeObserver) new ResizeObserver(refit).observe($("terminal"));
  fit.fit();
  $("terminal-size").textContent = term.cols + "×" + term.rows;

  // ---- Terminal connection -----------------------------------------------

  // "Session ended: terminated by you", "Session ended: exited with code 3", …
  function endedText(s) {
    var why = fgpu.endReason(s);
    return "Session ended" + (why ? ": " + why : " (" + s.status + ")");
  }

  function describeNotRunning(s) {
    if (FINAL.indexOf(s.status) !== -1) return endedText(s);
    if (s.status === "TERMINATING") return "Session is terminating" + (fgpu.endReason(s) ? " (" + fgpu.endReason(s) + ")" : "");
    var waiting = "Session is " + s.status + ": the terminal opens when it is RUNNING";
    return s.status_reason ? waiting + " (" + s.status_reason + ")" : waiting;
  }

  // Nothing to connect to: say why (waiting, ending, ended); an ended session shows its log.
  function showNotRunning() {
    var text = describeNotRunning(session);
    var final = FINAL.indexOf(session.status) !== -1;
    if (final) { showLog(); return; }
    setStatus("waiting", text);
    if (session.status === "TERMINATING") showBanner(text, { back: true, kind: "ended" });
    else showBanner("Waiting for the session to start…", { kind: "waiting" });
  }

  function connect() {
    clearTimeout(retryTimer);
    if (connecting || (socket && socket.readyState <= WebSocket.OPEN)) return;
    if (session.status !== "RUNNING") { showNotRunning(); return; }
    connecting = true;
    exited = false;
    hideBanner();
    setStatus("connecting", "Connecting…");
    fgpu.api("POST", sessionUrl + "terminal-ticket/", {}).then(function (r) {
      if (!r.ok) {
        var err = new Error(fgpu.errorText(r));
        err.signedOut = r.signedOut;
        throw err;
      }
      var url = /^wss?:\/\//.test(r.data.url) ? r.data.url : wsScheme + location.host + r.data.url;
      openSocket(url);
    }).catch(function (err) {
      connecting = false;
      if (err instanceof TypeError) { retryLater("The server cannot be reached"); return; } // fetch: no answer
      var text = "Could not open the terminal: " + err.message;
      setStatus("closed", text);
      showBanner(text, { reconnect: !err.signedOut, kind: "error" });
      if (!err.signedOut) refresh(); // perhaps it is no longer RUNNING: then the header says so
    });
  }

  // Connect again by ourselves, soon, waiting longer each time; the session's state is read
  // again first (it may have ended meanwhile: then the header and the banner say how).
  function retryLater(text) {
    var wait = Math.min(RETRY_MAX_S, Math.pow(2, retries++));
    setStatus("connecting", text + "; reconnecting in " + wait + " s…");
    clearTimeout(retryTimer);
    retryTimer = setTimeout(function () { refresh().then(connect); }, wait * 1000);
  }

  function openSocket(url) {
    var ws = new WebSocket(url);
    socket = ws;
    ws.onopen = function () {
      connecting = false;
      retries = 0;
      setStatus("connected", batch ? "Running" : "Connected");
      if (!batch) term.write("\x1b[?25h"); // show the cursor again after an earlier exit
      if (inputForm) inputForm.hidden = false;
      refit();
      sendSize();
      if (!batch) term.focus();
    };
    ws.onmessage = function (ev) {
      var msg;
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      if (msg.type === "output" && typeof msg.data === "string") {
        term.write(msg.data, keepAtEnd);
      } else if (msg.type === "exit") {
        exited = true;
        // The session's own notice (TERMINATED, with its reason) may come a moment later: until
        // then the exit code says it, and a terminate under way says who asked.
        var ending = FINAL.indexOf(session.status) !== -1 ? session : Object.assign({}, session, {
          status: "TERMINATED", exit_code: msg.code,
          status_reason: session.status === "TERMINATING" ? session.status_reason : "" });
        showEnded(ending);
        refresh();
      }
    };
    ws.onclose = function (ev) {
      connecting = false;
      if (socket === ws) socket = null;
      if (inputForm) inputForm.hidden = true;
      if (exited) return;
      var text = "Connection closed";
      if (ev.code === 4401 || ev.code === 4403) text += " (ticket refused)";
      else if (ev.reason) text += " (" + ev.reason + ")";
      // 1013: the server could not reach its message broker; 1012 ("service restart") and 1001
      // ("going away"): the server is stopping (uvicorn says 1012); 1011 and 1006: the connection
      // broke (a server that died); 4502: the server's direct stream to the session's agent broke
      // (an agent restart). The session may go on.
      var retry = [1013, 1012, 1001, 1011, 1006, 4502];
      if (retry.indexOf(ev.code) !== -1 && FINAL.indexOf(session.status) === -1) {
        retryLater(text);
        return;
      }
      setStatus("closed", text);
      showBanner(text, { reconnect: FINAL.indexOf(session.status) === -1, back: true, kind: "error" });
    };
  }

  var endWritten = false;
  function showEnded(s) {
    var text = endedText(s);
    setStatus("ended", text);
    showBanner(text, { back: true, kind: "ended" }); // under the log, not over it (css/session_page.css)
    if (endWritten || logPending) return; // the log's reader writes the end after the log
    endWritten = true;
    term.write("\r\n\x1b[2m[" + text.toLowerCase() + "]\x1b[0m\r\n\x1b[?25l", keepAtEnd); // and hide the cursor
  }

  // An ended session opened afresh: its log (what its process wrote, the last 4 Mi characters
  // kept by the server) in the pane, read page by page, then how it ended.
  var logRead = false, logPending = false;
  function showLog() {
    if (logRead) return;
    logRead = logPending = true;
    $("terminal-pane-title").textContent = "Log";
    setStatus("ended", "Reading the log…");
    term.write("\x1b[?25l");
    function read(since) {
      return fgpu.api("GET", sessionUrl + "logs/?since=" + since).then(function (r) {
        if (!r.ok || !r.data) throw new Error(fgpu.errorText(r));
        var d = r.data;
        if (since === 0 && d.truncated) term.write("\x1b[2m[the log's start is not kept: it shows its last part]\x1b[0m\r\n");
        if (d.text) term.write(d.text, keepAtEnd);
        if (d.next > since && d.text) return read(d.next);
        return d;
      });
    }
    read(0).then(function (d) {
      logPending = false;
      if (!d.length) term.write("\x1b[2m[no output]\x1b[0m\r\n");
      showEnded(session);
    }).catch(function (err) {
      logPending = false;
      showEnded(session);
      setStatus("ended", "Could not read the log: " + err.message);
    });
  }

  reconnectButton.addEventListener("click", function () {
    term.write("\r\n\x1b[2m[reconnecting…]\x1b[0m\r\n");
    refresh().then(connect);
  });

  // ---- Live session status -----------------------------------------------

  function applySession(s) {
    if (fgpu.isStale(s, session)) return; // an older state that arrived late
    var was = session.status;
    session = s;
    renderHeader();
    document.dispatchEvent(new CustomEvent("fgpu:session", { detail: s })); // the ETA panel (eta.js) follows it
    if (exited || (FINAL.indexOf(s.status) !== -1 && socket === null)) {
      if (FINAL.indexOf(s.status) !== -1) showEnded(s);
      return;
    }
    if (s.status === "RUNNING" && was !== "RUNNING") {
      connect();
    } else if (s.status !== "RUNNING" && !socket && !connecting) {
      showNotRunning();
    }
  }

  // The session as the server holds it now (after a reconnection, a failed ticket, an exit).
  function refresh() {
    return fgpu.api("GET", sessionUrl).then(function (r) {
      if (r.ok && r.data && r.data.id === session.id) applySession(r.data);
    }).catch(function () { /* the next reconnection tries again */ });
  }

  fgpu.watchSessions({
    onOpen: function () { refresh(); }, // also the first time: what changed since the page was made
    onSession: function (s) { if (s.id === session.id) applySession(s); },
  });
  connect();
})();
