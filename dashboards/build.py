"""Builds commlens' Grafana dashboards with Grafana's foundation SDK; the JSON beside it is its output.

    python dashboards/build.py          # rewrites dashboards/*.json (tests/test_dashboards.py checks they match)

Two dashboards, linked to each other by the "commlens" tag: an overview of every rank of the chosen
jobs and process groups, and a drill-down into one rank. Every query filters on the `job`, `pg` and
`rank` variables; latency queries ask for exemplars, which link to traces where the Prometheus data
source has a tracing data source configured for them (deploy/kubernetes/grafana-datasource.yaml).
"""

from __future__ import annotations

import json
import pathlib
import sys

from grafana_foundation_sdk.builders import dashboard, prometheus, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (DashboardCursorSync, DashboardLinkType, DataSourceRef,
                                                     FieldColorModeId, VariableRefresh, VariableSort)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from commlens.agent.verdicts.catalogue import VERDICT_ALERTS

HERE = pathlib.Path(__file__).resolve().parent
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
GROUP = 'job=~"$job", pg=~"$pg"'
SELECT = GROUP + ', rank=~"$rank"'
RANK = 'job=~"$job", rank=~"$rank"'


def query(expr: str, legend: str = "", exemplar: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).datasource(DATASOURCE).range()
    if legend:
        q = q.legend_format(legend)
    return q.exemplar(True) if exemplar else q


def graph(title: str, description: str, unit: str, *queries: prometheus.Dataquery,
          bars: bool = False) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
             .height(8).span(12))
    if bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80)
    for index, q in enumerate(queries):
        panel = panel.with_target(q.ref_id("ABCDEFGH"[index]))
    return panel


def latest(title: str, description: str, expr: str) -> table.Panel:
    """A table of the latest value of each series of ``expr``."""
    q = (prometheus.Dataquery().expr(expr).datasource(DATASOURCE).instant().format(PromQueryFormat.TABLE)
         .ref_id("A"))
    return table.Panel().title(title).description(description).datasource(DATASOURCE).height(8).span(12).with_target(q)


def verdicts() -> table.Panel:
    """The verdicts firing now: the alerts of the catalogue's kinds (``commlens.agent.verdicts``), each with
    what it names."""
    firing = f'ALERTS{{alertstate="firing", alertname=~"{"|".join(VERDICT_ALERTS)}", job=~"$job"}}'
    return latest("Verdicts firing", "What commlens names now, live: each alert of a verdict with the rank, node "
                  "or group it names (docs/runbooks.md says what to do). `commlens diagnose --prometheus` gives "
                  "the same verdicts with their evidence.",
                  f"max by (alertname, job, rank, node, pg, op) ({firing})").span(24)


def arrival() -> statetimeline.Panel:
    """Each rank's lateness in its group's collectives, over time: a row per rank and group."""
    def mean_wait(selector: str) -> str:
        return (f"sum by (job, pg, rank) (rate(commlens_collective_duration_seconds_sum{{{selector}}}[$__rate_interval]))"
                f" / sum by (job, pg, rank) (rate(commlens_collective_duration_seconds_count{{{selector}}}"
                "[$__rate_interval]))")
    lateness = f"max by (job, pg) ({mean_wait(GROUP)}) - on (job, pg) group_right {mean_wait(SELECT)}"
    colours = dashboard.FieldColor().mode(FieldColorModeId.CONTINUOUS_GR_YL_RD)
    return (statetimeline.Panel().title("Arrival: how much later each rank arrives").description(
        "In a synchronous collective a rank waits for the last to arrive, so the group's longest mean wait minus "
        "a rank's own is how much later that rank arrives, on average over the interval: the red row is the "
        "rank the others wait for. A latency panel's exemplar opens one collective's trace, every rank's span "
        "in it, where a trace backend is configured.").unit("s").datasource(DATASOURCE).height(8).span(24)
        .color_scheme(colours).fill_opacity(70).line_width(0).with_target(query(lateness, "rank {{rank}} · group {{pg}}").ref_id("A")))


def cost() -> timeseries.Panel:
    """What the rank that arrives last in each group costs the job (the recording rule
    ``commlens:wait_caused:ratio5m`` over the interval)."""
    waited = f"sum by (job, pg, rank) (rate(commlens_collective_duration_seconds_sum{{{GROUP}}}[$__rate_interval]))"
    caused = (f"sum by (job, pg) ({waited}) - on (job, pg) group_right () "
              f"({waited} * on (job, pg) group_left () count by (job, pg) ({waited}))")
    last = f"{waited} == on (job, pg) group_left () min by (job, pg) ({waited})"
    ranks = ('count by (job) (count by (job, rank) (commlens_collective_duration_seconds_count{job=~"$job"}))')
    return graph("Cost of the rank that arrives last", "In each group, the time its other members spend in its "
                 "collectives beyond the time of the rank that waits least there (the last to arrive): they "
                 "wait for it. As a share of the job's time, all its ranks' seconds. A straggler's line stands "
                 "out; CommlensStraggler quotes it over 5 min.", "percentunit",
                 query(f"(({caused}) and on (job, pg, rank) ({last})) / on (job) group_left () {ranks}",
                       "rank {{rank}} · group {{pg}}"))


def latency(selector: str) -> list[prometheus.Dataquery]:
    return [query(f"histogram_quantile({q}, sum by (op, le) "
                  f"(rate(commlens_collective_duration_seconds_bucket{{{selector}}}[$__rate_interval])))",
                  f"{{{{op}}}} p{round(q * 100)}", exemplar=True) for q in (0.5, 0.99)]


def busbw(selector: str) -> prometheus.Dataquery:
    return query(f"sum by (op) (rate(commlens_collective_bus_bytes_total{{{selector}}}[$__rate_interval]))"
                 f" / sum by (op) (rate(commlens_collective_duration_seconds_sum{{{selector}}}[$__rate_interval]))",
                 "{{op}}")


def events(metric: str, selector: str) -> prometheus.Dataquery:
    return query(f"sum by (rank, pg, op) (increase({metric}{{{selector}}}[$__rate_interval]))",
                 "rank {{rank}} · {{op}} · group {{pg}}")


def variables(rank_multi: bool) -> list:
    def label_values(name: str, source: str, multi: bool = True) -> dashboard.QueryVariable:
        variable = (dashboard.QueryVariable(name).label(name).datasource(DATASOURCE)
                    .query(f"label_values({source}, {name})").refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                    .sort(VariableSort.NATURAL_ASC))
        return variable.multi(True).include_all(True).all_value(".*") if multi else variable

    return [dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"),
            label_values("job", "commlens_info"),
            label_values("pg", 'commlens_collective_last_seq{job=~"$job"}'),
            label_values("rank", 'commlens_info{job=~"$job"}', multi=rank_multi)]


def base(title: str, uid: str, description: str, rank_multi: bool) -> dashboard.Dashboard:
    board = (dashboard.Dashboard(title).uid(uid).description(description).tags(["commlens"])
             .time("now-1h", "now").refresh("30s").tooltip(DashboardCursorSync.CROSSHAIR)
             .link(dashboard.DashboardLink("commlens").type(DashboardLinkType.DASHBOARDS).tags(["commlens"])
                   .as_dropdown(True).include_vars(True).keep_time(True)))
    for variable in variables(rank_multi):
        board = board.with_variable(variable)
    return board


def overview() -> dashboard.Dashboard:
    lag = (f'max by (job, pg) (commlens_collective_last_seq{{state="enqueued", {GROUP}}})'
           f' - on (job, pg) group_right commlens_collective_last_seq{{state="enqueued", {SELECT}}}')
    return (base("commlens — collectives", "commlens-overview",
                 "Every collective of the chosen jobs, process groups and ranks.", rank_multi=True)
            .with_row(dashboard.Row("Verdicts"))
            .with_panel(verdicts())
            .with_row(dashboard.Row("Collectives"))
            .with_panel(graph("Latency p50 / p99 by op", "Time from issue to completion; exemplars link to the "
                              "collective's trace.", "s", *latency(SELECT)))
            .with_panel(graph("Bus bandwidth by op", "Payload × the nccl-tests bus factor over time spent in "
                              "the collective.", "Bps", busbw(SELECT)))
            .with_panel(graph("Collectives per second", "Completed collectives, by op and status.", "ops",
                              query(f"sum by (op, status) (rate(commlens_collectives_total{{{SELECT}}}"
                                    "[$__rate_interval]))", "{{op}} {{status}}")))
            .with_panel(graph("Oldest in-flight collective", "Age of the oldest collective issued and not "
                              "completed; it climbs while a rank waits in a hang.", "s",
                              query(f"max by (rank, pg) (commlens_collective_inflight_oldest_seconds{{{SELECT}}})",
                                    "rank {{rank}} · group {{pg}}")))
            .with_row(dashboard.Row("Progress"))
            .with_panel(arrival())
            .with_panel(cost())
            .with_panel(graph("Collectives behind the group", "How far each rank's last issued collective is "
                              "behind the most advanced rank of its group: a rank that stays above 0 is the one "
                              "the others wait for.", "none", query(lag, "rank {{rank}} · group {{pg}}")))
            .with_panel(latest("Last completed collective by rank", "Sequence number of each rank's last "
                               "completed collective, per group.",
                               f'commlens_collective_last_seq{{state="completed", {SELECT}}}'))
            .with_row(dashboard.Row("Faults"))
            .with_panel(graph("Hangs", "In-flight collectives that crossed the hang threshold.", "none",
                              events("commlens_hangs_total", SELECT), bars=True))
            .with_panel(graph("NaN events", "Collectives whose input held NaN or Inf; the first rank is the "
                              "source.", "none", events("commlens_nan_events_total", SELECT), bars=True))
            .with_panel(graph("Nodes reached", "1 while Prometheus reaches every metrics endpoint of the node (its "
                              "pod sidecar, or each rank's own), 0 when it misses one: CommlensNodeUnreachable "
                              "names a node it reaches none of while the job waits.", "none",
                              query('min by (node) (up{job=~"$job"} * on (job, instance) group_left (node) '
                                    'max by (job, instance, node) (last_over_time(commlens_info{job=~"$job"}[15m])))',
                                    "{{node}}")))
            .with_panel(graph("Time in collectives by node", "The share of its time a node's ranks spend in "
                              "collectives, all groups: a slow node sits below the others (it computes while they "
                              "wait: CommlensNodeSlow), a slow network lifts every node towards 1 "
                              "(CommlensNetworkSlow).", "percentunit",
                              query('avg by (node) (sum by (job, rank) (rate(commlens_collective_duration_seconds_sum'
                                    '{job=~"$job"}[1m])) * on (job, rank) group_left (node) max by (job, rank, node) '
                                    '(commlens_info{job=~"$job"}))', "{{node}}")))
            .with_row(dashboard.Row("Telemetry health"))
            .with_panel(graph("Dropped ring records", "Records overwritten before the sidecar read them.",
                              "cps", query(f"sum by (rank) (rate(commlens_ring_records_dropped_total{{{RANK}}}"
                                           "[$__rate_interval]))", "rank {{rank}}")))
            .with_panel(graph("Spans by result", "Spans exported, failed, dropped from a full queue, or "
                              "sampled out.", "cps",
                              query(f"sum by (result) (rate(commlens_spans_exported_total{{{RANK}}}"
                                    "[$__rate_interval]))", "{{result}}"))))


def rank() -> dashboard.Dashboard:
    return (base("commlens — one rank", "commlens-rank",
                 "One rank's collectives, against its group's.", rank_multi=False)
            .with_row(dashboard.Row("Collectives of rank $rank"))
            .with_panel(graph("Latency p50 / p99 by op", "Time from issue to completion; exemplars link to the "
                              "collective's trace.", "s", *latency(SELECT)))
            .with_panel(graph("Latency p99 by payload size", "By size class of the payload.", "s",
                              query("histogram_quantile(0.99, sum by (size_class, le) (rate("
                                    f"commlens_collective_duration_seconds_bucket{{{SELECT}}}[$__rate_interval])))",
                                    "{{size_class}}", exemplar=True)))
            .with_panel(graph("Mean collective time: this rank and its group", "In a synchronous collective the "
                              "last rank to arrive waits least: a straggler sits well below its group.", "s",
                              query(f"sum by (op) (rate(commlens_collective_duration_seconds_sum{{{SELECT}}}"
                                    f"[$__rate_interval])) / sum by (op) (rate("
                                    f"commlens_collective_duration_seconds_count{{{SELECT}}}[$__rate_interval]))",
                                    "{{op}} rank $rank"),
                              query(f"sum by (op) (rate(commlens_collective_duration_seconds_sum{{{GROUP}}}"
                                    f"[$__rate_interval])) / sum by (op) (rate("
                                    f"commlens_collective_duration_seconds_count{{{GROUP}}}[$__rate_interval]))",
                                    "{{op}} group")))
            .with_panel(graph("Bus bandwidth by op", "Payload × the nccl-tests bus factor over time spent in "
                              "the collective.", "Bps", busbw(SELECT)))
            .with_row(dashboard.Row("Progress and faults"))
            .with_panel(graph("Sequence numbers", "Last collective issued (enqueued) and completed, per group.",
                              "none", query(f"commlens_collective_last_seq{{{SELECT}}}", "group {{pg}} {{state}}")))
            .with_panel(graph("In flight", "Collectives issued and not completed, and the oldest one's age.",
                              "none", query(f"commlens_collective_inflight{{{SELECT}}}", "group {{pg}} depth"),
                              query(f"commlens_collective_inflight_oldest_seconds{{{SELECT}}}",
                                    "group {{pg}} oldest (s)")))
            .with_panel(graph("Hangs and NaN events", "Per op and group.", "none",
                              events("commlens_hangs_total", SELECT).legend_format("hang · {{op}} · group {{pg}}"),
                              events("commlens_nan_events_total", SELECT).legend_format("NaN · {{op}} · group {{pg}}"),
                              bars=True))
            .with_panel(latest("Who this is", "commlens_info: rank, local rank, world size, backend, version.",
                               f"commlens_info{{{RANK}}}")))


DASHBOARDS = {"commlens-overview.json": overview, "commlens-rank.json": rank}


def render(build) -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> int:
    for name, build in DASHBOARDS.items():
        (HERE / name).write_text(render(build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
