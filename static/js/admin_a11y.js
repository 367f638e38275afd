// Accessible names Django's admin widgets lack (found by axe, tests/test_browser_contrast.py): the
// autocomplete fields' select2 combobox is labelled only by its current value, empty at first; it
// gets the field's label as well. Runs on every admin page (templates/admin/base_site.html).
(function () {
  "use strict";

  function nameComboboxes() {
    Array.prototype.forEach.call(document.querySelectorAll("select.admin-autocomplete"), function (select) {
      var label = select.id && document.querySelector('label[for="' + select.id + '"]');
      var box = select.nextElementSibling && select.nextElementSibling.querySelector(".select2-selection[role=combobox]");
      if (!label || !box) return;
      if (!label.id) label.id = select.id + "-label";
      var rendered = box.querySelector(".select2-selection__rendered");
      box.setAttribute("aria-labelledby", label.id + (rendered && rendered.id ? " " + rendered.id : ""));
      if (rendered) rendered.setAttribute("aria-label", label.textContent.replace(/:\s*$/, "").trim());
    });
  }
  // After the admin's own ready handlers (autocomplete.js sets select2 up in one, registered before
  // this deferred script runs; jQuery runs them in order).
  if (window.django && window.django.jQuery) window.django.jQuery(nameComboboxes);
  else window.addEventListener("load", nameComboboxes);
})();
