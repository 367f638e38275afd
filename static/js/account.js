// Profile page: copy the new token, confirm before revoking one. Works without it too.
(function () {
  "use strict";

  var copyButton = document.getElementById("copy-token");
  if (copyButton) {
    var field = document.getElementById(copyButton.getAttribute("data-copy"));
    field.addEventListener("focus", function () { field.select(); });
    field.focus();
    var reset = null;
    copyButton.addEventListener("click", function () {
      field.select();
      var copied = navigator.clipboard && window.isSecureContext
        ? navigator.clipboard.writeText(field.value).then(function () { return true; }, function () { return false; })
        : Promise.resolve(document.execCommand && document.execCommand("copy"));
      copied.then(function (ok) {
        copyButton.textContent = ok ? "Copied" : "Press Ctrl+C";
        copyButton.classList.toggle("is-copied", !!ok);
        clearTimeout(reset);
        reset = setTimeout(function () { copyButton.textContent = "Copy"; copyButton.classList.remove("is-copied"); }, 2000);
      });
    });
  }

  var dialog = document.getElementById("revoke-dialog");
  if (!dialog || typeof dialog.showModal !== "function") return;  // no <dialog>: forms post at once
  var pending = null;

  document.querySelectorAll(".revoke-form").forEach(function (form) {
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      pending = form;
      document.getElementById("revoke-name").textContent = form.getAttribute("data-token-name");
      dialog.returnValue = "";
      dialog.showModal();
      document.getElementById("revoke-cancel").focus();
    });
  });

  dialog.addEventListener("click", function (ev) { if (ev.target === dialog) dialog.close(); });
  dialog.addEventListener("close", function () {
    var form = pending;
    pending = null;
    if (dialog.returnValue !== "confirm" || !form) return;
    form.querySelector(".revoke-button").disabled = true;
    form.submit();  // submit() skips the submit event, so this does not ask again
  });
})();
