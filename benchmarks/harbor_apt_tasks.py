"""The ten apt-needing Harbor / Terminal-Bench 1 task folders that benchmarks/harbor_apt.py imports
and benches, written in the tasks' real formats (see that file's docstring)."""
from __future__ import annotations

import os
import textwrap

ROOT = [""]

HARBOR_TEST_SH = """#!/bin/bash
# Use this file to install test dependencies and run the tests.
# It will be copied to /tests/test.sh and run from the working directory.

apt-get update
apt-get install -y curl

curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh

source $HOME/.local/bin/env

# CTRF produces a standard test report in JSON format which is useful for logging.
uvx \\
  -p 3.13 \\
  -w pytest==8.4.1 \\
  -w pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA

if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""

TB1_RUN_TESTS = """#!/bin/bash

# Setup uv and pytest
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
source $HOME/.local/bin/env

# Check if we're in a valid working directory
if [ "$PWD" = "/" ]; then
    echo "Error: No working directory set. Please set a WORKDIR in your Dockerfile before running this script."
    exit 1
fi

uv venv .tbench-testing
source .tbench-testing/bin/activate
uv pip install pytest==8.4.1

# Run pytest
uv run pytest $TEST_DIR/test_outputs.py -rA
"""


def toml(name, difficulty, category, tags, desc):
    return textwrap.dedent(f"""\
        schema_version = "1.3"

        [task]
        name = "apt-suite/{name}"
        description = "{desc}"
        authors = [{{ name = "kiln issue 21", email = "kiln@example.invalid" }}]
        keywords = {tags!r}

        [metadata]
        difficulty = "{difficulty}"
        category = "{category}"

        [verifier]
        timeout_sec = 120.0

        [agent]
        timeout_sec = 600.0

        [environment]
        build_timeout_sec = 600.0
        cpus = 1
        memory_mb = 2048
        storage_mb = 10240
        """).replace("'", '"')


def write(folder, files):
    for rel, text in files.items():
        p = os.path.join(ROOT[0], folder, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(textwrap.dedent(text) if not rel.endswith(("test.sh", "run-tests.sh")) else text)
        if rel.endswith(".sh"):
            os.chmod(p, 0o755)


def harbor(name, difficulty, category, tags, desc, instruction, dockerfile, env_files, tests, solve):
    write(name, {"task.toml": toml(name, difficulty, category, tags, desc), "instruction.md": instruction,
                 "environment/Dockerfile": dockerfile, **{f"environment/{k}": v for k, v in env_files.items()},
                 "tests/test.sh": HARBOR_TEST_SH, "tests/test_outputs.py": tests,
                 "solution/solve.sh": "#!/bin/bash\nset -e\n" + textwrap.dedent(solve)})



# Terminal-Bench 1 format: task.yaml, Dockerfile, solution.sh, run-tests.sh, tests/ ----------------------
def tb1(name, instruction, dockerfile, files, tests, solution):
    write(name, {"task.yaml": "instruction: |-\n" + textwrap.indent(instruction, "  ") +
                 "author_name: kiln issue 21\nauthor_email: kiln@example.invalid\ndifficulty: medium\n"
                 "category: system-administration\ntags:\n  - shell\nparser_name: pytest\n"
                 "max_agent_timeout_sec: 360.0\nmax_test_timeout_sec: 60.0\nrun_tests_in_same_shell: false\n",
                 "Dockerfile": dockerfile, "docker-compose.yaml": textwrap.dedent("""\
                    services:
                      client:
                        build:
                          dockerfile: Dockerfile
                        image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
                        container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}
                        command: [ "sh", "-c", "sleep infinity" ]
                        environment:
                          - TEST_DIR=${T_BENCH_TEST_DIR}
                        volumes:
                          - ${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}
                    """),
                 "run-tests.sh": TB1_RUN_TESTS, "tests/test_outputs.py": tests,
                 "solution.sh": "#!/bin/bash\n" + textwrap.dedent(solution), **files})



def write_tasks(root: str) -> list[str]:
    """The ten task folders under `root`; their names."""
    ROOT[0] = root
    # 1. jq ---------------------------------------------------------------------------------------------
    harbor("jq-admins", "easy", "data-processing", ["jq", "json"], "List the admin users of a JSON export",
           "The file /app/users.json is an export of user accounts.\n\nWrite the names of every user whose role is "
           "`admin` to /app/admins.txt, one per line, sorted alphabetically. Use `jq`, which is installed.\n",
           """\
           FROM ubuntu:24.04
           RUN apt-get update && apt-get install -y jq && rm -rf /var/lib/apt/lists/*
           WORKDIR /app
           COPY users.json /app/users.json
           """,
           {"users.json": '[{"name": "zoe", "role": "admin"}, {"name": "al", "role": "dev"},\n'
                          ' {"name": "bea", "role": "admin"}, {"name": "cy", "role": "ops"},\n'
                          ' {"name": "ann", "role": "admin"}]\n'},
           """\
           import json
           import subprocess


           def test_admins_file():
               with open("/app/admins.txt") as f:
                   assert f.read().split() == ["ann", "bea", "zoe"]


           def test_jq_is_the_images():
               out = subprocess.run(["jq", "-r", ".[0].name", "/app/users.json"], capture_output=True, text=True)
               assert out.stdout.strip() == "zoe"
           """,
           """\
           cd /app
           jq -r '.[] | select(.role == "admin") | .name' users.json | sort > admins.txt
           """)

    # 2. sqlite3 ----------------------------------------------------------------------------------------
    harbor("sqlite-top-customer", "medium", "data-querying", ["sqlite", "sql"], "Find the best customer in a SQLite database",
           "/app/shop.db is a SQLite database with tables `customers(id, name)` and `orders(id, customer_id, amount)`.\n\n"
           "Write the name of the customer with the largest total order amount to /app/top_customer.txt (just the "
           "name). The `sqlite3` command-line shell is installed.\n",
           """\
           FROM debian:bookworm
           RUN apt-get update && apt-get install -y --no-install-recommends sqlite3 && rm -rf /var/lib/apt/lists/*
           WORKDIR /app
           COPY schema.sql /tmp/schema.sql
           RUN sqlite3 /app/shop.db < /tmp/schema.sql && rm /tmp/schema.sql
           """,
           {"schema.sql": """\
            CREATE TABLE customers(id INTEGER PRIMARY KEY, name TEXT);
            CREATE TABLE orders(id INTEGER PRIMARY KEY, customer_id INTEGER, amount REAL);
            INSERT INTO customers VALUES (1, 'Ada'), (2, 'Grace'), (3, 'Linus');
            INSERT INTO orders VALUES (1, 1, 20.0), (2, 2, 15.5), (3, 2, 30.0), (4, 3, 40.0), (5, 1, 5.0);
            """},
           """\
           import sqlite3


           def test_top_customer():
               with open("/app/top_customer.txt") as f:
                   assert f.read().strip() == "Grace"


           def test_database_untouched():
               rows = sqlite3.connect("/app/shop.db").execute("select count(*) from orders").fetchone()
               assert rows == (5,)
           """,
           """\
           cd /app
           sqlite3 shop.db "SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id
                            GROUP BY c.id ORDER BY SUM(o.amount) DESC LIMIT 1;" > top_customer.txt
           """)

    # 3. python3-numpy ----------------------------------------------------------------------------------
    harbor("numpy-column-means", "easy", "scientific-computing", ["numpy", "csv"], "Column means of a CSV matrix",
           "/app/matrix.csv holds a numeric matrix (comma-separated, no header).\n\nWrite the mean of each column to "
           "/app/means.txt, one per line, rounded to 3 decimals. numpy is installed for python3.\n",
           """\
           FROM ubuntu:24.04
           ENV DEBIAN_FRONTEND=noninteractive
           RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-numpy \\
               && rm -rf /var/lib/apt/lists/*
           WORKDIR /app
           COPY matrix.csv /app/
           """,
           {"matrix.csv": "1,2,3\n4,5,6\n7,8,10\n2.5,0,1\n"},
           """\
           import numpy as np


           def test_means():
               expected = np.loadtxt("/app/matrix.csv", delimiter=",").mean(axis=0)
               with open("/app/means.txt") as f:
                   got = [float(x) for x in f.read().split()]
               assert len(got) == 3 and np.allclose(got, expected, atol=5e-4)
           """,
           """\
           cd /app
           python3 -c "import numpy as np; [print(f'{m:.3f}') for m in np.loadtxt('matrix.csv', delimiter=',').mean(axis=0)]" > means.txt
           """)

    # 4. bc ---------------------------------------------------------------------------------------------
    harbor("bc-sqrt2", "easy", "mathematics", ["bc", "precision"], "The square root of 2 to 50 decimals",
           "Write the square root of 2, truncated to exactly 50 digits after the decimal point, to /app/sqrt2.txt "
           "(like `1.4142...`). The arbitrary-precision calculator `bc` is installed.\n",
           """\
           FROM debian:trixie-slim
           RUN apt-get update && apt-get install -y --no-install-recommends bc && rm -rf /var/lib/apt/lists/*
           WORKDIR /app
           RUN echo "write sqrt2.txt here" > /app/README
           """,
           {},
           """\
           from decimal import Decimal, getcontext, ROUND_DOWN


           def test_sqrt2():
               getcontext().prec = 80
               want = Decimal(2).sqrt().quantize(Decimal(1).scaleb(-50), rounding=ROUND_DOWN)
               with open("/app/sqrt2.txt") as f:
                   assert f.read().strip().replace("\\\\\\n", "") == str(want)
           """,
           """\
           cd /app
           echo "scale=50; sqrt(2)" | BC_LINE_LENGTH=0 bc > sqrt2.txt
           """)

    # 5. libxml2-utils (xmllint) -------------------------------------------------------------------------
    harbor("xmllint-fix-config", "medium", "debugging", ["xml", "xmllint"], "Repair a malformed XML config",
           "/app/config.xml does not parse: `xmllint --noout /app/config.xml` fails. Fix it so that it is well-formed "
           "XML, keeping every setting and its value.\n",
           """\
           FROM ubuntu:22.04
           RUN apt-get update && apt-get install -y libxml2-utils && rm -rf /var/lib/apt/lists/*
           WORKDIR /app
           COPY config.xml .
           """,
           {"config.xml": '<?xml version="1.0"?>\n<config>\n  <port>8080</port>\n  <host>localhost</host>\n'
                          '  <debug>true</debug>\n  <name>alpha & beta</name>\n</config>\n'},
           """\
           import subprocess
           import xml.etree.ElementTree as ET


           def test_well_formed():
               assert subprocess.run(["xmllint", "--noout", "/app/config.xml"]).returncode == 0


           def test_settings_kept():
               root = ET.parse("/app/config.xml").getroot()
               assert {c.tag: c.text for c in root} == {"port": "8080", "host": "localhost", "debug": "true",
                                                        "name": "alpha & beta"}
           """,
           """\
           cd /app
           sed -i 's/alpha & beta/alpha \\&amp; beta/' config.xml
           """)

    # 6. gawk -------------------------------------------------------------------------------------------
    harbor("gawk-word-counts", "easy", "text-processing", ["awk", "text"], "Word frequencies with gawk",
           "Count how often each word occurs in /app/corpus.txt (words are separated by whitespace; compare them "
           "lower-cased). Write `word count` lines to /app/counts.txt, most frequent first, ties alphabetical. GNU awk "
           "(`gawk`) is installed.\n",
           """\
           FROM ubuntu:24.04
           RUN apt-get update && apt-get install -y gawk && rm -rf /var/lib/apt/lists/*
           WORKDIR /app
           COPY corpus.txt /app/corpus.txt
           """,
           {"corpus.txt": "The cat and the dog\nthe Dog barked AND the cat ran\n"},
           """\
           def test_counts():
               with open("/app/counts.txt") as f:
                   lines = [l.split() for l in f.read().splitlines() if l.strip()]
               assert lines == [["the", "4"], ["and", "2"], ["cat", "2"], ["dog", "2"], ["barked", "1"], ["ran", "1"]]
           """,
           """\
           cd /app
           gawk '{for (i = 1; i <= NF; i++) n[tolower($i)]++} END {for (w in n) print w, n[w]}' corpus.txt \\
             | sort -k2,2nr -k1,1 > counts.txt
           """)

    # 7. python3-yaml -----------------------------------------------------------------------------------
    harbor("yaml-to-json", "easy", "file-operations", ["yaml", "json"], "Convert a YAML config to JSON",
           "Convert /app/service.yaml to JSON at /app/service.json with the same data. Python 3 with PyYAML is "
           "installed.\n",
           """\
           FROM ubuntu:24.04
           RUN apt-get update && apt-get install -y python3 python3-yaml && rm -rf /var/lib/apt/lists/*
           WORKDIR /app
           COPY service.yaml .
           """,
           {"service.yaml": "name: api\nreplicas: 3\nports:\n  - 80\n  - 443\nenv:\n  DEBUG: false\n  REGION: eu-west-1\n"},
           """\
           import json

           import yaml


           def test_same_data():
               with open("/app/service.yaml") as f:
                   want = yaml.safe_load(f)
               with open("/app/service.json") as f:
                   assert json.load(f) == want
           """,
           """\
           cd /app
           python3 -c "import json, yaml; json.dump(yaml.safe_load(open('service.yaml')), open('service.json', 'w'), indent=2)"
           """)

    # 8. zip / unzip ------------------------------------------------------------------------------------
    harbor("unzip-line-count", "easy", "file-operations", ["zip", "shell"], "Count lines inside a zip archive",
           "/app/logs.zip holds several log files. Write the total number of lines across all of them to "
           "/app/total_lines.txt. `unzip` is installed.\n",
           """\
           FROM ubuntu:24.04
           RUN apt-get update && apt-get install -y zip unzip && rm -rf /var/lib/apt/lists/*
           WORKDIR /app
           COPY a.log b.log c.log /tmp/logs/
           RUN cd /tmp/logs && zip -q /app/logs.zip a.log b.log c.log && rm -r /tmp/logs
           """,
           {"a.log": "one\ntwo\nthree\n", "b.log": "four\nfive\n", "c.log": "six\nseven\neight\nnine\nten\n"},
           """\
           import os


           def test_total():
               with open("/app/total_lines.txt") as f:
                   assert f.read().strip() == "10"


           def test_archive_kept():
               assert os.path.getsize("/app/logs.zip") > 0
           """,
           """\
           cd /app
           unzip -p logs.zip | wc -l | tr -d ' ' > total_lines.txt
           """)


    # 9. git --------------------------------------------------------------------------------------------
    tb1("git-find-commit",
        "The repository in /app/repo once had a file named secret.txt added to it. Write the full hash of the commit\n"
        "that added it to /app/answer.txt.\n",
        """\
        FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624
        RUN apt-get update && apt-get install -y git tmux asciinema && rm -rf /var/lib/apt/lists/*
        WORKDIR /app
        COPY make_repo.sh /tmp/make_repo.sh
        RUN bash /tmp/make_repo.sh && rm /tmp/make_repo.sh
        """,
        {"make_repo.sh": textwrap.dedent("""\
            set -e
            export GIT_AUTHOR_NAME=dev GIT_AUTHOR_EMAIL=dev@example.invalid GIT_COMMITTER_NAME=dev
            export GIT_COMMITTER_EMAIL=dev@example.invalid GIT_AUTHOR_DATE=2024-01-01T00:00:00 GIT_COMMITTER_DATE=2024-01-01T00:00:00
            git init -q /app/repo && cd /app/repo
            echo a > a.txt && git add a.txt && git commit -qm "add a"
            echo s > secret.txt && git add secret.txt && git commit -qm "add notes"
            git rm -q secret.txt && git commit -qm "remove notes"
            echo b > b.txt && git add b.txt && git commit -qm "add b"
            """)},
        """\
        import subprocess


        def test_answer():
            want = subprocess.run(["git", "-C", "/app/repo", "log", "--diff-filter=A", "--format=%H", "--", "secret.txt"],
                                  capture_output=True, text=True).stdout.strip()
            with open("/app/answer.txt") as f:
                assert len(want) == 40 and f.read().strip() == want
        """,
        """\
        cd /app/repo
        git log --diff-filter=A --format=%H -- secret.txt > /app/answer.txt
        """)

    # 10. units -----------------------------------------------------------------------------------------
    tb1("units-convert",
        "Using the `units` program, convert 42 miles to kilometres and write the number alone (at least 4 significant\n"
        "digits) to /app/km.txt.\n",
        """\
        FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620
        RUN apt-get update && apt-get install -y units && rm -rf /var/lib/apt/lists/*
        WORKDIR /app
        """,
        {},
        """\
        import shutil
        import subprocess


        def test_km():
            with open("/app/km.txt") as f:
                assert abs(float(f.read().strip()) - 67.59245) < 1e-3


        def test_units_installed():
            assert shutil.which("units") and subprocess.run(["units", "-t", "1 km", "m"], capture_output=True,
                                                            text=True).stdout.strip() == "1000"
        """,
        """\
        units -t '42 miles' km > /app/km.txt
        """)
    return sorted(os.listdir(root))
