"""The API's pagination (a module of its own: DRF imports it while defining its generic views)."""

from __future__ import annotations

from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination


MAX_LIMIT = 1000  # items per page
MAX_OFFSET = 2**63 - 1 - MAX_LIMIT  # offset + limit must fit the database's 64-bit LIMIT/OFFSET


class StrictLimitOffsetPagination(LimitOffsetPagination):
    """DRF's limit/offset pagination, except that a `limit` that is not a whole number from 1
    to MAX_LIMIT (1000), or an `offset` that is not one from 0 (up to the database's 64-bit
    range), is a 400 naming it instead of being ignored or clamped silently."""

    max_limit = MAX_LIMIT

    def _parameter(self, request, name: str, minimum: int, maximum: int) -> int | None:
        raw = request.query_params.get(name)
        if raw is None:
            return None
        try:
            value = int(raw, 10) if len(raw) <= 20 else None  # int() of 4,300 digits and more raises
        except ValueError:
            value = None
        if value is None or not minimum <= value <= maximum:
            raise serializers.ValidationError({name: [f"expected a whole number from {minimum} to {maximum}"]})
        return value

    def get_limit(self, request):
        limit = self._parameter(request, self.limit_query_param, 1, self.max_limit)
        return self.default_limit if limit is None else limit

    def get_offset(self, request):
        return self._parameter(request, self.offset_query_param, 0, MAX_OFFSET) or 0

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.limit_query_param:
                parameter["schema"].update(minimum=1, maximum=self.max_limit)
            elif parameter["name"] == self.offset_query_param:
                parameter["schema"].update(minimum=0, maximum=MAX_OFFSET)
        return parameters
