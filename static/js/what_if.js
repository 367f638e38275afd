// Admin → Projects → a project: "What if" before saving a new fair-share weight (issue 17.5).
// Sends POST /api/v1/scheduler/what-if/ {"share_weights": {<project>: <typed weight>}} and lists
// each waiting session's start today and with that weight. Nothing is saved. No build step.
(function () {
  "use strict";

  var box = document.getElementById("what-if");
  if (!box) return;
  var $ = function (id) { return document.getElementById(id); };
  var weightInput = document.getElementById("id_share_weight");
  var WORDS = { sooner: "sooner", later: "later", same: "no change", unknown: "cannot tell" };

  function csrfToken() {
    var input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  function when(band) {
    if (band.outcome === "now") return "now";
    if (band.outcome === "never") return "never";
    if (!band.earliest) return "unknown";
    var fmt = function (iso) {
      return new Date(iso).toLocaleString([], { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
                                                hour12: false });
    };
    if (!band.latest) return "from " + fmt(band.earliest);
    var a = fmt(band.earliest), b = fmt(band.latest);
    return a === b ? a : a + " – " + b;
  }

  function cell(row, text, cls) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
  }

  function show(data) {
    var rows = $("what-if-rows");
    rows.textContent = "";
    var counts = { sooner: 0, later: 0 };
    data.sessions.forEach(function (s) {
      var tr = document.createElement("tr");
      cell(tr, s.name);
      cell(tr, s.owner);
      cell(tr, s.position_today === s.position_what_if ? "#" + s.position_today
        : "#" + s.position_today + " → #" + s.position_what_if);
      cell(tr, when(s.today));
      cell(tr, when(s.what_if));
      cell(tr, WORDS[s.change] || s.change, "what-if-change what-if-" + s.change);
      if (s.change in counts) counts[s.change] += 1;
      rows.appendChild(tr);
    });
    $("what-if-summary").textContent = data.sessions.length
      ? counts.sooner + " waiting session(s) would start sooner, " + counts.later + " later."
      : "No session is waiting: the weight changes nothing now.";
    $("what-if-result").hidden = false;
  }

  $("what-if-run").addEventListener("click", function () {
    var weight = parseInt(weightInput ? weightInput.value : box.getAttribute("data-saved-weight"), 10);
    var note = $("what-if-note");
    if (!(weight >= 1)) { note.textContent = "The weight must be a whole number of at least 1."; return; }
    var weights = {};
    weights[box.getAttribute("data-project")] = weight;
    note.textContent = "Replaying the queue…";
    fetch(box.getAttribute("data-url"), {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "Accept": "application/json", "X-CSRFToken": csrfToken() },
      body: JSON.stringify({ share_weights: weights }),
    }).then(function (r) {
      return r.json().then(function (data) { return { ok: r.ok, data: data }; });
    }).then(function (r) {
      if (!r.ok) { note.textContent = "Could not preview: " + (r.data.detail || "error"); return; }
      note.textContent = "Weight " + weight + " (saved: " + box.getAttribute("data-saved-weight") + "), replayed at " +
        new Date(r.data.computed_at).toLocaleTimeString([], { hour12: false }) + ". Nothing was saved.";
      show(r.data);
    }).catch(function () { note.textContent = "Could not reach the server."; });
  });
})();
