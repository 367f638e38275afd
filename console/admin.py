"""The admin site's name and look: "fGPU Console administration", styled by the console's own
stylesheet variables (templates/admin/base_site.html, static/css/admin.css)."""

from django.contrib import admin

admin.site.site_header = "fGPU Console administration"
admin.site.site_title = "fGPU Console admin"
admin.site.index_title = "Accelerators, sessions and people"
