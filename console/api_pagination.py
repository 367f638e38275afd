"""The API's pagination (a module of its own: DRF imports it while defining its generic views)."""
from __future__ import annotations

from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination


class StrictLimitOffsetPagination(LimitOffsetPagination):
    """DRF's limit/offset pagination, except that a `limit` or `offset` that is not a whole
    number ≥ 0 (≥ 1 for limit) is a 400 naming it instead of being ignored silently."""

    def _parameter(self, request, name: str, minimum: int) -> int | None:
        raw = request.query_params.get(name)
        if raw is None:
            return None
        try:
            value = int(raw, 10)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise serializers.ValidationError({name: [f"expected a whole number of at least {minimum}"]})
        return value

    def get_limit(self, request):
        limit = self._parameter(request, self.limit_query_param, 1)
        if limit is None:
            return self.default_limit
        return min(limit, self.max_limit) if self.max_limit else limit

    def get_offset(self, request):
        return self._parameter(request, self.offset_query_param, 0) or 0

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.limit_query_param:
                parameter["schema"]["minimum"] = 1
            elif parameter["name"] == self.offset_query_param:
                parameter["schema"]["minimum"] = 0
        return parameters
