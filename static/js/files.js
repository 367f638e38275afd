// The session page's file panel (templates/sessions/includes/files_panel.html): list a folder of
// the session's home (data/ is the owner's persistent folder), upload with progress
// (XMLHttpRequest: fetch reports no upload progress), download (a plain link: the browser
// streams it), delete after a confirmation. Everything goes through /api/v1/sessions/<id>/files/.
// Sharing (issue 36.5, /api/v1/shares/): share the owner's folders with a user or a project, list
// the shares (revoke, leave); shared/<name> is read-only unless shared read-write, so the panel
// offers no upload or delete there (the API answers 403 anyway).
(function () {
  "use strict";
  var panel = document.getElementById("files-panel");
  if (!panel) return;
  var $ = function (id) { return document.getElementById(id); };
  var listUrl = panel.dataset.url, contentUrl = panel.dataset.contentUrl;
  var rows = $("files-rows"), crumbs = $("files-crumbs"), errorBox = $("files-error"), uploads = $("files-uploads");
  var dialog = $("file-delete-dialog");
  var here = "", loaded = false, pendingDelete = null;
  var readOnly = {}; // shared/<name> → read-only (from the shared/ listing and the shares received)

  function inReadOnly(path) {
    var parts = path.split("/");
    return parts[0] === "shared" && parts.length > 1 && readOnly[parts[1]] !== false;
  }

  function join(dir, name) { return dir ? dir + "/" + name : name; }
  function q(path) { return "?path=" + encodeURIComponent(path); }

  function size(n) {
    if (n < 1024) return n + " B";
    var units = ["KiB", "MiB", "GiB", "TiB"], i = -1;
    do { n /= 1024; i++; } while (n >= 1024 && i < units.length - 1);
    return n.toFixed(n < 10 ? 1 : 0) + " " + units[i];
  }

  function when(epoch) {
    var d = new Date(epoch * 1000);
    return d.toLocaleDateString() + " " + d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }

  function showError(text) { errorBox.textContent = text; errorBox.hidden = !text; }

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function renderCrumbs() {
    crumbs.textContent = "";
    var parts = here ? here.split("/") : [];
    var home = el("button", { type: "button", "class": "files-crumb", "data-path": "" }, "Home");
    crumbs.appendChild(home);
    parts.forEach(function (part, i) {
      crumbs.appendChild(el("span", { "class": "files-crumb-sep", "aria-hidden": "true" }, "/"));
      var path = parts.slice(0, i + 1).join("/");
      var b = el("button", { type: "button", "class": "files-crumb", "data-path": path }, part);
      if (i === parts.length - 1) b.setAttribute("aria-current", "location");
      crumbs.appendChild(b);
    });
  }

  function message(text) {
    rows.textContent = "";
    var tr = el("tr"), td = el("td", { colspan: "4", "class": "muted" }, text);
    tr.appendChild(td);
    rows.appendChild(tr);
  }

  function render(listing) {
    rows.textContent = "";
    var locked = inReadOnly(here);
    $("files-upload").disabled = locked || here === "shared";
    panel.querySelector(".files-upload-label").classList.toggle("is-disabled", locked || here === "shared");
    if (here === "shared") listing.entries.forEach(function (e) { readOnly[e.name] = e.read_only !== false; });
    if (!listing.entries.length) {
      message(here === "shared" ? "Nothing is shared with you yet." : locked ? "This folder is empty." : "This folder is empty. Upload a file to it.");
      return;
    }
    listing.entries.forEach(function (e) {
      var path = join(here, e.name), tr = el("tr", { "data-name": e.name });
      var name = el("td", { "class": "files-name" });
      if (e.type === "dir") {
        var open = el("button", { type: "button", "class": "files-open", "data-path": path }, e.name + "/");
        name.appendChild(open);
        if (here === "shared") {
          name.appendChild(el("span", { "class": "files-tag" + (e.read_only !== false ? " is-read-only" : ""),
                                        title: "Shared with you" }, e.read_only !== false ? "read-only" : "read-write"));
        } else if (e.persistent) name.appendChild(el("span", { "class": "files-tag", title: "Kept across sessions and mounted into each new one" }, "persistent"));
      } else {
        name.appendChild(el("span", { "class": "files-file" }, e.name));
        if (e.type === "link") name.appendChild(el("span", { "class": "files-tag", title: "A symbolic link: not followed here" }, "link"));
      }
      tr.appendChild(name);
      tr.appendChild(el("td", { "class": "num" }, e.type === "file" ? size(e.size) : ""));
      tr.appendChild(el("td", { "class": "muted" }, when(e.mtime)));
      var actions = el("td", { "class": "files-row-actions" });
      if (e.type === "file") {
        actions.appendChild(el("a", { "class": "button button-small", href: contentUrl + q(path), download: e.name,
                                      "aria-label": "Download " + e.name }, "Download"));
      }
      if (!e.persistent && path !== ".fgpu" && path !== "shared" && !locked) { // .fgpu/: the console's own files (read-only here)
        actions.appendChild(el("button", { type: "button", "class": "button button-small button-danger-ghost files-delete",
                                           "data-path": path, "aria-label": "Delete " + e.name }, "Delete"));
      }
      tr.appendChild(actions);
      rows.appendChild(tr);
    });
    if (listing.truncated) message("… and more: only the first 5,000 entries are shown.");
  }

  function load(path) {
    here = path;
    renderCrumbs();
    return fgpu.api("GET", listUrl + q(path)).then(function (r) {
      loaded = true;
      if (r.ok) { showError(""); render(r.data); return; }
      if (r.status === 409) { showError(""); message("Files are reached while the session is RUNNING."); return; }
      showError(fgpu.errorText(r));
    }).catch(function () { showError("Could not reach the server. Try again."); });
  }

  function upload(file) {
    var path = join(here, file.name);
    var item = el("li", { "class": "files-upload" });
    var label = el("span", { "class": "files-upload-name" }, file.name);
    var bar = el("progress", { max: "100", value: "0", "aria-label": "Uploading " + file.name });
    var pct = el("span", { "class": "files-upload-pct" }, "0 %");
    item.appendChild(label); item.appendChild(bar); item.appendChild(pct);
    uploads.appendChild(item);
    var xhr = new XMLHttpRequest();
    xhr.open("PUT", contentUrl + q(path));
    xhr.setRequestHeader("X-CSRFToken", fgpu.csrfToken());
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    xhr.setRequestHeader("Accept", "application/json");
    xhr.upload.onprogress = function (ev) {
      if (!ev.lengthComputable) return;
      var p = Math.floor(ev.loaded * 100 / ev.total);
      bar.value = p;
      pct.textContent = p === 100 ? "sending to the session…" : p + " %";
    };
    xhr.onload = function () {
      var data = null;
      try { data = JSON.parse(xhr.responseText); } catch (e) { data = null; }
      if (xhr.status === 201) {
        bar.value = 100;
        pct.textContent = "done";
        item.classList.add("is-done");
        setTimeout(function () { item.remove(); }, 4000);
        load(here);
      } else {
        item.classList.add("is-failed");
        pct.textContent = fgpu.errorText({ status: xhr.status, data: data, signedOut: fgpu.isSignedOut(xhr.status, data) });
      }
    };
    xhr.onerror = function () { item.classList.add("is-failed"); pct.textContent = "the upload was interrupted"; };
    xhr.send(file);
  }

  panel.addEventListener("toggle", function () { if (panel.open && !loaded) load(here); });
  $("files-refresh").addEventListener("click", function () { load(here); });
  $("files-upload").addEventListener("change", function (ev) {
    Array.prototype.forEach.call(ev.target.files, upload);
    ev.target.value = "";
  });
  panel.addEventListener("click", function (ev) {
    var target = ev.target.closest("button");
    if (!target) return;
    if (target.classList.contains("files-open") || target.classList.contains("files-crumb")) {
      load(target.dataset.path);
    } else if (target.classList.contains("files-delete")) {
      pendingDelete = target.dataset.path;
      $("file-delete-name").textContent = pendingDelete;
      dialog.showModal();
    }
  });
  dialog.addEventListener("close", function () {
    var path = pendingDelete;
    pendingDelete = null;
    if (dialog.returnValue !== "confirm" || !path) return;
    fgpu.api("DELETE", listUrl + q(path)).then(function (r) {
      if (!r.ok) showError(fgpu.errorText(r));
      load(here);
    });
  });
  // The session may start running after the page was made: list again when its badge says so.
  var badge = $("session-status-badge");
  if (badge) {
    new MutationObserver(function () {
      if (panel.open && badge.textContent.trim() === "RUNNING") load(here);
    }).observe(badge, { childList: true, characterData: true, subtree: true });
  }
  renderCrumbs();

  // --- sharing ----------------------------------------------------------------------------
  var sharesUrl = panel.dataset.sharesUrl, shareList = $("files-shares"), shareError = $("share-error");
  var sharesLoaded = false;

  function showShareError(text) { shareError.textContent = text; shareError.hidden = !text; }

  function shareRow(s) {
    var li = el("li", { "class": "files-share", "data-share": s.id });
    var perm = s.permission === "ro" ? "read-only" : "read-write";
    var text;
    if (s.managed && !s.received) {
      text = s.folder + "/ shared with " + (s.user ? s.user : "project " + s.to_project) + " as shared/" + s.name;
    } else {
      text = "shared/" + s.name + " from " + (s.owner ? s.owner : "project " + s.project) +
        (s.to_project ? " (to project " + s.to_project + ")" : "");
    }
    li.appendChild(el("span", { "class": "files-share-text" }, text));
    li.appendChild(el("span", { "class": "files-tag" + (s.permission === "ro" ? " is-read-only" : "") }, perm));
    var label = s.managed ? "Revoke" : s.user ? "Leave" : "";
    if (label) {
      li.appendChild(el("button", { type: "button", "class": "button button-small button-danger-ghost files-share-revoke",
                                    "data-share": s.id, "aria-label": label + " " + text }, label));
    }
    return li;
  }

  function loadShares() {
    return fgpu.api("GET", sharesUrl).then(function (r) {
      if (!r.ok) { showShareError(fgpu.errorText(r)); return; }
      sharesLoaded = true;
      showShareError("");
      var select = $("share-folder"), chosen = select.value;
      select.textContent = "";
      r.data.folders.forEach(function (f) {
        select.appendChild(el("option", { value: f }, f === "data" ? "data/ (yours)" : f + "/"));
      });
      if (chosen && r.data.folders.indexOf(chosen) >= 0) select.value = chosen;
      shareList.textContent = "";
      var writable = {};
      r.data.shares.forEach(function (s) {
        if (s.received) writable[s.name] = writable[s.name] || s.permission === "rw";
        shareList.appendChild(shareRow(s));
      });
      Object.keys(writable).forEach(function (name) { readOnly[name] = !writable[name]; });
      if (!r.data.shares.length) shareList.appendChild(el("li", { "class": "muted" }, "No folder is shared by or with you."));
    }).catch(function () { showShareError("Could not reach the server. Try again."); });
  }

  panel.addEventListener("toggle", function () { if (panel.open && !sharesLoaded) loadShares(); });
  $("share-kind").addEventListener("change", function (ev) {
    $("share-who").placeholder = ev.target.value === "user" ? "user name" : "project name";
  });
  $("files-share-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    var who = $("share-who").value.trim();
    if (!who) { showShareError("Name the " + $("share-kind").value + " to share the folder with."); $("share-who").focus(); return; }
    var body = { folder: $("share-folder").value, permission: $("share-permission").value };
    body[$("share-kind").value] = who;
    fgpu.api("POST", sharesUrl, body).then(function (r) {
      if (!r.ok) { showShareError(fgpu.errorText(r)); return; }
      $("share-who").value = "";
      loadShares();
    });
  });
  shareList.addEventListener("click", function (ev) {
    var target = ev.target.closest("button.files-share-revoke");
    if (!target) return;
    fgpu.api("DELETE", sharesUrl + target.dataset.share + "/").then(function (r) {
      if (!r.ok) showShareError(fgpu.errorText(r));
      loadShares();
      if (here.split("/")[0] === "shared") load(here);
    });
  });
})();
