// Sort the index table by a clicked column (numbers by data-v, text otherwise); "#sort=max" or
// "#sort=layer-asc" in the address sorts on load. No dependencies, nothing fetched.
document.querySelectorAll("table.sortable-table").forEach(function (table) {
  var heads = Array.prototype.slice.call(table.querySelectorAll("th.sortable"));
  function sortBy(th, descending) {
    heads.forEach(function (other) { other.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", descending ? "descending" : "ascending");
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var index = heads.indexOf(th);
    var numeric = th.classList.contains("num");
    rows.sort(function (a, b) {
      var x = a.cells[index].getAttribute("data-v"), y = b.cells[index].getAttribute("data-v");
      var order = numeric ? parseFloat(x) - parseFloat(y) : x.localeCompare(y);
      return descending ? -order : order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  }
  heads.forEach(function (th) {
    th.addEventListener("click", function () { sortBy(th, th.getAttribute("aria-sort") !== "descending"); });
  });
  var wanted = /sort=([a-z_]+)(-asc)?/.exec(window.location.hash);
  if (wanted) {
    heads.forEach(function (th) { if (th.getAttribute("data-key") === wanted[1]) { sortBy(th, !wanted[2]); } });
  }
});
