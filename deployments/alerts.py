"""Create the alerting Automation (deployments/automations/rlhf-alerts.yaml) and the notification
block it sends through, on the Prefect server of PREFECT_API_URL.

    python -m deployments.alerts --webhook URL [--kind slack|webhook] [--block-name rlhf-alerts]

``--kind slack`` (the default) makes a Slack Webhook block (also Mattermost/Discord-compatible
incoming webhooks), ``--kind webhook`` a Custom Webhook block that POSTs JSON
{"subject", "body"} to URL. Run again to replace both (same names).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import httpx
import yaml
from prefect.blocks.notifications import CustomWebhookNotificationBlock, SlackWebhook
from prefect.client.orchestration import get_client
from prefect.events.schemas.automations import AutomationCore
from prefect.exceptions import PrefectHTTPStatusError
from prefect.settings import PREFECT_API_URL

AUTOMATION_FILE = Path(__file__).resolve().parent / "automations" / "rlhf-alerts.yaml"
BLOCK_PLACEHOLDER = "BLOCK_DOCUMENT_ID"


def automation_spec(block_document_id: str, path: Path = AUTOMATION_FILE) -> dict[str, Any]:
    """The automation of ``path`` with its notification actions pointed at ``block_document_id``."""
    spec = yaml.safe_load(path.read_text())
    for action in spec["actions"]:
        if action.get("block_document_id") == BLOCK_PLACEHOLDER:
            action["block_document_id"] = str(block_document_id)
    return spec


def notification_block(kind: str, url: str):
    """The block the automation notifies through: a Slack-style incoming webhook, or a plain JSON POST."""
    if kind == "slack":
        return SlackWebhook(url=url)
    if kind == "webhook":
        return CustomWebhookNotificationBlock(name="rlhf-alerts", url=url, method="POST",
                                              json_data={"subject": "{{subject}}", "body": "{{body}}"})
    raise ValueError(f"unknown --kind {kind!r}; valid: slack, webhook")


def create_alerting(url: str, kind: str = "slack", block_name: str = "rlhf-alerts") -> tuple[str, str]:
    """Save the notification block and (re)create the automation; returns (block id, automation id)."""
    block_id = notification_block(kind, url).save(block_name, overwrite=True)
    spec = automation_spec(str(block_id))
    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(spec["name"]):
            client.delete_automation(old.id)
        automation_id = client.create_automation(AutomationCore(**spec))
    return str(block_id), str(automation_id)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--webhook", required=True, help="where notifications go (an incoming-webhook URL)")
    parser.add_argument("--kind", choices=("slack", "webhook"), default="slack")
    parser.add_argument("--block-name", default="rlhf-alerts")
    args = parser.parse_args(argv)
    api = PREFECT_API_URL.value()
    if not api:  # Prefect would start a throwaway server of its own and the automation would vanish with it
        print("PREFECT_API_URL is not set: point it at the Prefect server the runs report to "
              "(python -m deployments.services status prints it)", file=sys.stderr)
        return 2
    try:
        block_id, automation_id = create_alerting(args.webhook, args.kind, args.block_name)
    except (httpx.HTTPError, PrefectHTTPStatusError) as exc:
        print(f"could not create the automation on {api}: {exc}", file=sys.stderr)
        return 1
    print(f"automation rlhf-alerts {automation_id} notifies through block {args.block_name} ({block_id})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
