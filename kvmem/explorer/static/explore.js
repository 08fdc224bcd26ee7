// kvmem explorer: the one script of the pages (served from the package; the CSP allows no other).
// It only adds conveniences: pages that need the model reload themselves when it is ready, and
// the left and right arrow keys step to the neighbouring neurons. Every page works without it.
"use strict";
(function () {
  function pollModel() {
    var waiting = document.querySelector("[data-needs-model]");
    var pill = document.getElementById("model-state");
    if (!waiting && !(pill && document.body.dataset.modelState === "loading")) { return; }
    var timer = setInterval(function () {
      fetch("/api/status", { headers: { "Accept": "application/json" } })
        .then(function (r) { return r.json(); })
        .then(function (status) {
          var state = status.model.state;
          if (pill) { pill.textContent = "model " + state; pill.className = "model-pill state-" + state; }
          if (state !== "loading") {
            clearInterval(timer);
            document.body.dataset.modelState = state;
            if (waiting && state === "ready") { window.location.reload(); }
          }
        })
        .catch(function () { clearInterval(timer); });
    }, 1500);
  }
  function neighbourKeys() {
    if (!document.body.dataset.neuron) { return; }
    var keys = { ArrowLeft: "prev-neuron", ArrowRight: "next-neuron" };
    document.addEventListener("keydown", function (event) {
      var target = event.target;
      if (event.altKey || event.ctrlKey || event.metaKey || event.shiftKey) { return; }
      if (target && /^(INPUT|TEXTAREA|SELECT)$/.test(target.tagName)) { return; }
      var link = keys[event.key] && document.getElementById(keys[event.key]);
      if (link) { window.location.href = link.href; }
    });
  }
  document.addEventListener("DOMContentLoaded", function () { pollModel(); neighbourKeys(); });
})();
