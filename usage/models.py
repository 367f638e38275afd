"""Usage samples, their 5-minute means, and the idle-reclamation policy.

Times of samples are whole epoch seconds (`t`, UTC), so that 5-minute buckets are integer
arithmetic on every database (`t - t % 300`). Units: memory in bytes, utilisation in percent,
CPU in milli-cores (1000 = one core busy), `span` in seconds (how long a sample stands for).
A rollup keeps sums over its samples' spans (`*_s` columns: value × seconds), so means and
"hours" come out exact: mean = sum / span_s; GiB-hours = sum / 3600 / 2^30.
Hourly and daily sums of the 5-minute ones (SessionPeriodRollup) let a month's report read
about 30 rows per session instead of 8,640.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


class SessionSample(models.Model):
    """One sample of one session at full resolution (kept FGPU_USAGE_RAW_RETENTION, a day).
    (session, t) is unique: a batch delivered twice, or out of order, is stored once."""

    session = models.ForeignKey("compute_sessions.ComputeSession", on_delete=models.CASCADE, related_name="+")
    t = models.BigIntegerField(help_text="epoch seconds")
    span = models.PositiveIntegerField(help_text="seconds this sample stands for")
    gpu_memory = models.BigIntegerField(null=True, help_text="bytes of GPU memory used; null: unknown")
    gpu_util = models.SmallIntegerField(null=True, help_text="GPU utilisation, percent; null: unknown")
    cpu = models.IntegerField(null=True, help_text="milli-cores; null: unknown (a session's first sample)")
    mem = models.BigIntegerField(null=True, help_text="bytes of main memory resident")
    storage = models.BigIntegerField(
        null=True, help_text="bytes in its home and container layer at the agent's last measure; null: not measured yet"
    )
    storage_limit = models.BigIntegerField(
        null=True, help_text="bytes: the session storage limit its agent enforces (agent.toml [limits] session-storage)"
    )

    class Meta:
        constraints = [models.UniqueConstraint(fields=["session", "t"], name="usage_session_sample_unique")]
        indexes = [models.Index(fields=["t"], name="usage_session_sample_t")]  # retention and rollup windows


class FolderUse(models.Model):
    """What one persistent data folder holds on one node, as its agent last measured it (agent.storage):
    a user's `~/data` (`owner`) or a project's `~/projects/<name>` (`project`), never both. Each node
    keeps its own folders (under its data root), so a user has one row per node they ran on. `t`
    (epoch seconds) is the sample the figures came with; an older sample never overwrites a newer."""

    node = models.ForeignKey("accelerators.Node", on_delete=models.CASCADE, related_name="+")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.CASCADE, related_name="+")
    project = models.ForeignKey("compute_sessions.Project", null=True, on_delete=models.CASCADE, related_name="+")
    used = models.BigIntegerField(help_text="bytes allocated to its files")
    limit = models.BigIntegerField(help_text="bytes: the limit its agent enforces ([limits] user- or project-data-storage)")
    t = models.BigIntegerField(help_text="epoch seconds of the measure's sample")

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(owner__isnull=False, project__isnull=True)
                | models.Q(owner__isnull=True, project__isnull=False),
                name="usage_folder_use_one_subject",
            ),
            models.UniqueConstraint(
                fields=["node", "owner"], condition=models.Q(project__isnull=True), name="usage_folder_use_user"
            ),
            models.UniqueConstraint(
                fields=["node", "project"], condition=models.Q(owner__isnull=True), name="usage_folder_use_project"
            ),
        ]


class DeviceSample(models.Model):
    """One sample of one device at full resolution; (device, t) unique."""

    device = models.ForeignKey("accelerators.Device", on_delete=models.CASCADE, related_name="+")
    t = models.BigIntegerField(help_text="epoch seconds")
    memory_used = models.BigIntegerField(help_text="bytes")
    memory_total = models.BigIntegerField(help_text="bytes")
    util = models.SmallIntegerField(null=True, help_text="percent; null: unknown (MIG devices)")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["device", "t"], name="usage_device_sample_unique")]
        indexes = [models.Index(fields=["t"], name="usage_device_sample_t")]


class RollupSums(models.Model):
    """The columns a session's rollup keeps over its samples' spans, at every level."""

    samples = models.PositiveIntegerField()
    span_s = models.PositiveIntegerField(help_text="seconds covered by samples")
    gpu_memory_s = models.BigIntegerField(default=0, help_text="Σ bytes × seconds (known samples)")
    gpu_memory_max = models.BigIntegerField(null=True)
    gpu_util_s = models.BigIntegerField(default=0, help_text="Σ percent × seconds")
    gpu_util_max = models.SmallIntegerField(null=True)
    gpu_span_s = models.PositiveIntegerField(default=0, help_text="seconds whose GPU figures are known")
    cpu_s = models.BigIntegerField(default=0, help_text="Σ milli-cores × seconds")
    mem_max = models.BigIntegerField(null=True, help_text="bytes")

    class Meta:
        abstract = True


class SessionRollup(RollupSums):
    """A session's samples in one 5-minute bucket [bucket, bucket + 300) (kept
    FGPU_USAGE_ROLLUP_RETENTION, 90 days). Sums are over the samples' spans: a mean is
    sum / `span_s`; a gap lowers `span_s`, never the means."""

    session = models.ForeignKey("compute_sessions.ComputeSession", on_delete=models.CASCADE, related_name="+")
    bucket = models.BigIntegerField(help_text="epoch seconds, a multiple of 300")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["session", "bucket"], name="usage_session_rollup_unique")]
        indexes = [models.Index(fields=["bucket"], name="usage_session_rollup_bucket")]


class SessionPeriodRollup(RollupSums):
    """A session's 5-minute rollups summed over one hour or one day [start, start + width)
    (usage.services.usage_rollup writes a period once all its buckets are closed, from them;
    kept as long as the 5-minute rollups). Same columns, same units as SessionRollup: sums over
    the samples' spans (value × seconds), maxima over the period. The accounting report reads
    whole periods inside its range (usage.selectors.usage_report)."""

    HOUR, DAY = 3600, 86400

    session = models.ForeignKey("compute_sessions.ComputeSession", on_delete=models.CASCADE, related_name="+")
    width = models.PositiveIntegerField(choices=[(HOUR, "hour"), (DAY, "day")], help_text="seconds: 3600 or 86400")
    start = models.BigIntegerField(help_text="epoch seconds, a multiple of width")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["session", "width", "start"], name="usage_session_period_unique")]
        indexes = [models.Index(fields=["width", "start"], name="usage_session_period_start")]


class DeviceRollup(models.Model):
    """A device's samples in one 5-minute bucket."""

    device = models.ForeignKey("accelerators.Device", on_delete=models.CASCADE, related_name="+")
    bucket = models.BigIntegerField(help_text="epoch seconds, a multiple of 300")
    samples = models.PositiveIntegerField()
    memory_used_avg = models.BigIntegerField(help_text="bytes")
    memory_used_max = models.BigIntegerField(help_text="bytes")
    memory_total = models.BigIntegerField(help_text="bytes")
    util_avg = models.SmallIntegerField(null=True, help_text="percent")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["device", "bucket"], name="usage_device_rollup_unique")]
        indexes = [models.Index(fields=["bucket"], name="usage_device_rollup_bucket")]


class RollupState(models.Model):
    """One row: every 5-minute bucket before `watermark` (epoch seconds) is rolled up and
    closed; a sample older than it is refused as too late (usage.services.usage_ingest). Every
    hour before `hour_watermark` and every day before `day_watermark` has its
    SessionPeriodRollup rows (0: none yet); both stay at or below `watermark`."""

    watermark = models.BigIntegerField(default=0)
    hour_watermark = models.BigIntegerField(default=0)
    day_watermark = models.BigIntegerField(default=0)


class IdlePolicy(models.Model):
    """When a resource group reclaims sessions (Backend.AI's idle checkers): an interactive
    session whose GPU utilisation stayed under `gpu_util_threshold` percent and whose terminal
    saw no input for `idle_timeout` seconds is warned, and terminated `grace` seconds later if
    it stays idle; any session is terminated `max_lifetime` seconds after it started (warned
    `grace` before). `resource_group` null: the policy of sessions on nodes in no group.
    Batch sessions (with a command) are never reclaimed as idle; max lifetime applies to them."""

    resource_group = models.OneToOneField(
        "accelerators.ResourceGroup", null=True, blank=True, on_delete=models.CASCADE, related_name="idle_policy"
    )
    gpu_util_threshold = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(0), MaxValueValidator(100)],
        help_text="percent: a session using less than this is idle",
    )
    idle_timeout = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(60)],
        help_text="seconds idle (GPU under the threshold, no terminal input) before the warning; empty: never",
    )
    max_lifetime = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(60)], help_text="seconds a session may run at most; empty: no limit"
    )
    grace = models.PositiveIntegerField(
        default=600, validators=[MinValueValidator(10)], help_text="seconds between the warning and the termination"
    )

    class Meta:
        verbose_name = "idle policy"
        verbose_name_plural = "idle policies"
        constraints = [
            models.UniqueConstraint(
                fields=["resource_group"], condition=models.Q(resource_group__isnull=True), name="usage_idle_policy_one_default"
            )
        ]

    def __str__(self) -> str:
        return f"idle policy of {self.resource_group or 'nodes in no group'}"

    def clean(self) -> None:
        """Refuses a grace (seconds) not shorter than the maximum lifetime (seconds): the lifetime's
        warning comes `grace` seconds before its end, so such a pair would warn at the start.
        (usage.services.usage_idle_check still ends a session at its lifetime for a pair written
        another way.) Raises ValidationError naming `grace`."""
        super().clean()
        if self.max_lifetime is not None and self.grace is not None and self.grace >= self.max_lifetime:
            raise ValidationError(
                {
                    "grace": f"must be shorter than the maximum lifetime ({self.max_lifetime} s): the "
                    "lifetime's warning comes this long before its end"
                }
            )


class SessionActivity(models.Model):
    """What idle reclamation knows of one running session: the last terminal input and the
    last busy sample the agents reported, and the warning given (`deadline`: when it is
    terminated unless it becomes busy; `reason`: why)."""

    session = models.OneToOneField(
        "compute_sessions.ComputeSession", primary_key=True, on_delete=models.CASCADE, related_name="activity"
    )
    last_input = models.BigIntegerField(null=True, help_text="epoch seconds of the last terminal input")
    last_sample = models.BigIntegerField(null=True, help_text="epoch seconds of the last sample")
    deadline = models.DateTimeField(null=True, blank=True)
    reason = models.CharField(max_length=200, blank=True)


class UsageReport(SessionRollup):
    """No table of its own: the admin's accounting page (usage.admin.UsageReportAdmin)."""

    class Meta:
        proxy = True
        verbose_name = "usage report"
        verbose_name_plural = "usage report"
