// The page that opens a session app (issue 16): asks the console to start it over
// /ws/sessions/<id>/open/<app>/, shows the progress, then goes to the app (this tab was opened
// for it). An error shows the console's words and the app's last output, with "Try again".
(function () {
  "use strict";
  const root = document.getElementById("app-open");
  if (!root || root.dataset.status !== "RUNNING") return;
  const state = document.getElementById("app-open-state");
  const progress = document.getElementById("app-open-progress");
  const text = document.getElementById("app-open-text");
  const failure = document.getElementById("app-open-error");
  const detail = document.getElementById("app-open-detail");
  const output = document.getElementById("app-open-output");

  function open() {
    failure.hidden = true;
    progress.hidden = false;
    text.textContent = "asking the session's node";
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + root.dataset.ws);
    let done = false;
    socket.onmessage = function (event) {
      const message = JSON.parse(event.data);
      if (message.type === "progress") {
        text.textContent = message.text;
      } else if (message.type === "ready") {
        done = true;
        state.textContent = message.reused ? "It is running: opening it." : "It started: opening it.";
        text.textContent = "opening " + message.url;
        location.replace(message.url);
      } else if (message.type === "error") {
        done = true;
        fail(message.title, message.detail);
      }
    };
    socket.onclose = function (event) {
      if (done) return;
      if (event.code === 4401) fail("Signed out", "Sign in again, then open the app from the session list.");
      else if (event.code === 4404) fail("Not found", "There is no such session or app.");
      else fail("Connection lost", "The connection to the console closed before the app answered.");
    };
  }

  function fail(title, message) {
    progress.hidden = true;
    state.textContent = title;
    const at = message.indexOf("; its last output:\n");
    detail.textContent = at < 0 ? message : message.slice(0, at);
    output.hidden = at < 0;
    output.textContent = at < 0 ? "" : message.slice(at + "; its last output:\n".length);
    failure.hidden = false;
  }

  document.getElementById("app-open-retry").addEventListener("click", open);
  open();
})();
