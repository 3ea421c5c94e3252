//! The tool on a PostgreSQL outbox: `migrate DIR URL` moves a file outbox,
//! and every command takes the `postgres://` URL where it takes a directory.
//! Runs against the throwaway server of `tests/support/postgres.rs` (skipped
//! with a printed reason outside CI when PostgreSQL is missing; fails in CI).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::harness::{Fixture, cli};
use crate::pg_server::PgServer;

/// Every file under `dir` with its bytes.
fn tree(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

#[test]
fn a_migrated_outbox_is_operated_through_its_url() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let Fixture { dir, outbox } = Fixture::demo();
    let d = dir.path().to_str().unwrap();

    // The bot still has it open: refused, naming the owner file.
    cli(["migrate", d, &url])
        .exits(1)
        .complains("the outbox is in use")
        .complains(".owner");
    drop(outbox);
    let before = tree(dir.path());
    cli(["migrate", d, &url])
        .exits(0)
        .says("migrated 6 live items and ")
        .says("verified");
    assert_eq!(tree(dir.path()), before, "the directory is only read");
    // Again: the schema holds an outbox now.
    cli(["migrate", d, &url]).exits(1).complains("is not empty");

    cli(["status", &url])
        .exits(1)
        .says("NEEDS ATTENTION")
        .says("6 total: 2 queued")
        .says("1 failed item(s) may have been delivered");
    // The server trusts loopback logins, so a password is accepted and ignored:
    // the report names the outbox without it.
    let with_password = url.replacen("postgres@", "postgres:sekrit@", 1);
    let run = cli(["status", &with_password]);
    run.exits(1).says("postgres://postgres@127.0.0.1");
    assert!(!run.stdout.contains("sekrit"), "{run:#?}");
    cli(["list", &url])
        .exits(0)
        .says("queued-1")
        .says("timeout-1");
    cli(["show", &url, "welcome"]).exits(0).says("tg-1");
    cli(["find", &url, "tg-2"]).exits(0).says("order-17");
    cli(["verify", &url]).exits(0).says("verified");
    cli([
        "requeue",
        &url,
        "timeout-1",
        "--reason",
        "checked: not delivered",
    ])
    .exits(0);
    cli([
        "cancel",
        &url,
        "--destination",
        "chat-2",
        "--reason",
        "obsolete",
    ])
    .exits(0);
    let export = cli(["export", &url, "--audit"]).exits(0).stdout.clone();
    let head = cli(["status", &url, "--json"]).exits(0).json()["audit"]["head_seq"].clone();
    assert_eq!(
        export.lines().count() as u64,
        head.as_u64().unwrap(),
        "every record exported, the operator actions included"
    );
    assert!(export.contains("checked: not delivered"));
    cli(["verify", &url]).exits(0).says("verified");
}

#[test]
fn a_schema_names_where_a_url_outbox_lives_and_is_refused_for_a_directory() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let Fixture { dir, outbox } = Fixture::demo();
    drop(outbox);
    let d = dir.path().to_str().unwrap();
    cli(["migrate", d, &url, "--schema", "bot_a"]).exits(0);
    cli(["list", &url, "--schema", "bot_a"])
        .exits(0)
        .says("welcome");
    // The default schema holds no outbox: refused, not made.
    cli(["list", &url])
        .exits(2)
        .complains("\"durable_outbox\" holds no outbox");
    cli(["list", d, "--schema", "bot_a"])
        .exits(2)
        .complains("--schema applies to a postgres:// URL");
    cli(["migrate", d, "/not/a/url"])
        .exits(2)
        .complains("postgres://");
}

#[test]
fn a_password_given_as_a_url_parameter_is_never_printed() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let Fixture { dir, outbox } = Fixture::demo();
    drop(outbox);
    cli(["migrate", dir.path().to_str().unwrap(), &url]).exits(0);
    // libpq's other way to give a password, which the client accepts: a
    // query parameter, with the user in the credentials or beside it.
    let in_query = format!("{url}?password=sekrit&application_name=ops");
    let no_credentials = in_query.replacen("postgres@", "", 1) + "&user=postgres";
    for with_password in [in_query, no_credentials] {
        let run = cli(["status", &with_password]);
        run.exits(1).says("127.0.0.1");
        assert!(!run.stdout.contains("sekrit"), "{run:#?}");
        assert!(!run.stderr.contains("sekrit"), "{run:#?}");
        let run = cli(["status", &with_password, "--json"]);
        run.exits(1);
        assert!(!run.stdout.contains("sekrit"), "{run:#?}");
    }
}

#[test]
fn a_schema_or_database_holding_no_outbox_is_refused_and_nothing_is_created() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let Fixture { dir, outbox } = Fixture::demo();
    drop(outbox);
    cli([
        "migrate",
        dir.path().to_str().unwrap(),
        &url,
        "--schema",
        "bot_a",
    ])
    .exits(0);
    let schemas = || {
        db.psql(
            "SELECT string_agg(nspname, ',' ORDER BY nspname) FROM pg_namespace \
             WHERE nspname NOT LIKE 'pg\\_%' AND nspname NOT IN ('information_schema', 'public')",
        )
    };
    assert_eq!(schemas().trim(), "bot_a");
    // A mistyped schema, and the URL alone (its default schema is not the
    // one the outbox was migrated to): every command that reads, as for a
    // directory that is not an outbox, exits 2 naming the schema.
    let head = format!("1:{}", "ab".repeat(32));
    let reads: [&[&str]; 8] = [
        &["status"],
        &["status", "--json"],
        &["list"],
        &["list", "--history"],
        &["show", "welcome"],
        &["verify"],
        &["verify", "--expect-head", &head],
        &["export", "--audit"],
    ];
    for (schema, named) in [(Some("bot_b"), "\"bot_b\""), (None, "\"durable_outbox\"")] {
        for read in reads {
            let mut args = vec![read[0], &url];
            args.extend(&read[1..]);
            if let Some(schema) = schema {
                args.extend(["--schema", schema]);
            }
            let run = cli(&args);
            run.exits(2)
                .complains(&format!("schema {named} holds no outbox"));
            assert!(!run.stdout.contains("verified"), "{args:?}: {run:#?}");
        }
    }
    // So do the commands that write: nothing to requeue in an outbox that is not there.
    cli([
        "requeue", &url, "welcome", "--schema", "bot_b", "--reason", "r",
    ])
    .exits(2);
    assert_eq!(schemas().trim(), "bot_a", "no schema was created");
    cli(["verify", &url, "--schema", "bot_a"])
        .exits(0)
        .says("verified");
}

#[test]
fn a_look_at_a_schema_before_the_bot_made_it_leaves_the_bots_settings_to_the_bot() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    // An operator looks before the bot's first start (or at a mistyped
    // schema): the tool has no settings of the bot's to store.
    let _ = cli(["status", &url]);
    let _ = cli(["list", &url]);
    let outbox = durable_outbox::Outbox::postgres(&url)
        .rate_limit(3, std::time::Duration::from_secs(7))
        .max_attempts(9)
        .open()
        .unwrap();
    let settings = outbox.settings().unwrap();
    assert_eq!(
        (settings.rate_limit().count, settings.max_attempts()),
        (3, 9),
        "the bot's first open stores the bot's settings, not the tool's defaults"
    );
}

#[test]
fn a_malformed_url_or_schema_is_a_usage_error() {
    let Fixture { dir, outbox } = Fixture::demo();
    drop(outbox);
    let d = dir.path().to_str().unwrap();
    // Refused before any connection: nothing listens on port 1 anyway.
    for args in [
        vec!["status", "postgres://bot@127.0.0.1:notaport/db"],
        vec![
            "list",
            "postgres://bot@127.0.0.1:1/db",
            "--schema",
            "Bad-Name",
        ],
        vec!["migrate", d, "postgres://bot@127.0.0.1:notaport/db"],
        vec![
            "migrate",
            d,
            "postgres://bot@127.0.0.1:1/db",
            "--schema",
            "Bad-Name",
        ],
    ] {
        let run = cli(args.clone());
        run.exits(2).complains("For more information, try '--help'");
        assert!(
            run.stderr.contains("url") || run.stderr.contains("schema"),
            "{args:?} names the argument: {run:#?}"
        );
    }
    // Not an outbox: the same as every command that takes a directory.
    let empty = tempfile::tempdir().unwrap();
    cli([
        "migrate",
        empty.path().to_str().unwrap(),
        "postgres://bot@127.0.0.1:1/db",
    ])
    .exits(2)
    .complains("not an outbox directory");
    cli(["status", empty.path().to_str().unwrap()])
        .exits(2)
        .complains("not an outbox directory");
}

#[test]
fn looking_at_a_url_outbox_prunes_no_history() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    // A bot whose clock says January keeps history a week: by the tool's
    // clock its sent item is long past retention.
    let clock = durable_outbox::ManualClock::at("2026-01-15T09:00:00Z").unwrap();
    let bot = durable_outbox::Outbox::postgres(&url)
        .clock(clock.clone())
        .sleeper(clock)
        .history_retention(durable_outbox::Retention::MaxAge(
            std::time::Duration::from_secs(7 * 86_400),
        ))
        .open()
        .unwrap();
    bot.enqueue(crate::harness::message("old-sent", "chat-1"))
        .unwrap();
    bot.process("old-sent", |_| Ok(Some("tg-old".into())))
        .unwrap();
    let head = bot.audit_head().unwrap();
    for command in ["status", "list", "verify", "export"] {
        let _ = cli([command, &url]);
    }
    assert_eq!(
        bot.audit_head().unwrap(),
        head,
        "the tool wrote no record (a retention prune is the bot's to make)"
    );
    assert!(bot.get("old-sent").unwrap().is_some(), "nothing was pruned");
}

#[test]
fn an_unreachable_server_is_an_error_that_hides_the_password() {
    // Nothing listens on port 1.
    let run = cli([
        "status",
        "postgres://bot:sekrit@127.0.0.1:1/db?connect_timeout=2",
    ]);
    run.exits(1).complains("postgres: connect failed");
    assert!(!run.stderr.contains("sekrit"), "{run:#?}");
}

/// The outbox schema version this release writes: what a bot's open leaves
/// in a schema of its own.
#[cfg(feature = "test-failpoints")]
fn this_releases_schema_version(db: &crate::pg_server::PgDatabase<'_>) -> i64 {
    drop(
        durable_outbox::Outbox::postgres(&db.url())
            .schema("version_probe")
            .open()
            .unwrap(),
    );
    db.psql("SELECT version FROM version_probe.outbox_meta")
        .trim()
        .parse()
        .unwrap()
}

#[cfg(feature = "test-failpoints")]
#[test]
fn the_tool_never_migrates_an_older_schema_as_it_looks_and_upgrade_schema_does() {
    let Some(server) = PgServer::shared() else {
        return;
    };
    let db = server.database();
    let url = db.url();
    let current = this_releases_schema_version(&db);
    let previous = current - 1;
    // The outbox as a bot of the previous release left it, still running
    // there: one item sent (with the platform's id) and one queued.
    let bot = durable_outbox::Outbox::postgres(&url)
        .schema("bot_a")
        .schema_version_for_tests(previous)
        .open()
        .unwrap();
    bot.enqueue(crate::harness::message("welcome", "chat-1"))
        .unwrap();
    bot.process("welcome", |_| Ok(Some("tg-1".into()))).unwrap();
    bot.enqueue(crate::harness::message("later", "chat-2"))
        .unwrap();
    drop(bot);
    let version = || db.psql("SELECT version FROM bot_a.outbox_meta");
    let tables = || {
        db.psql(
            "SELECT string_agg(table_name || '.' || column_name, ',' \
               ORDER BY table_name, column_name) \
             FROM information_schema.columns WHERE table_schema = 'bot_a'",
        )
    };
    assert_eq!(version().trim(), previous.to_string());
    let tables_before = tables();

    // Every command refuses it with exit 2, names the versions and the way
    // to upgrade, and leaves the tables as the older bots need them.
    let head = format!("1:{}", "ab".repeat(32));
    let commands: [&[&str]; 11] = [
        &["status"],
        &["status", "--json"],
        &["list"],
        &["list", "--history"],
        &["show", "welcome"],
        &["find", "tg-1"],
        &["verify"],
        &["verify", "--expect-head", &head],
        &["export", "--audit"],
        &["requeue", "welcome", "--reason", "r"],
        &["cancel", "later", "--reason", "r"],
    ];
    for command in commands {
        let mut args = vec![command[0], &url, "--schema", "bot_a"];
        args.extend(&command[1..]);
        let run = cli(&args);
        run.exits(2)
            .complains(&format!(
                "postgres schema \"bot_a\" is at outbox schema version {previous}, \
                 older than this release's {current}"
            ))
            .complains("nothing was written")
            .complains("durable-outbox upgrade-schema URL");
        assert!(!run.stdout.contains("verified"), "{args:?}: {run:#?}");
        assert_eq!(version().trim(), previous.to_string(), "{args:?} migrated");
        assert_eq!(tables(), tables_before, "{args:?} changed the tables");
    }

    // The explicit step migrates, once; then the tool works as on any outbox.
    cli(["upgrade-schema", &url, "--schema", "bot_a"])
        .exits(0)
        .says(&format!(
            "upgraded schema \"bot_a\" from outbox schema version {previous} to {current}"
        ));
    assert_eq!(version().trim(), current.to_string());
    cli(["upgrade-schema", &url, "--schema", "bot_a"])
        .exits(0)
        .says("at this release's schema version already; nothing was changed");
    cli(["list", &url, "--schema", "bot_a"])
        .exits(0)
        .says("welcome")
        .says("later");
    cli(["find", &url, "tg-1", "--schema", "bot_a"])
        .exits(0)
        .says("welcome");
    cli(["verify", &url, "--schema", "bot_a"])
        .exits(0)
        .says("verified");
    cli([
        "cancel", &url, "later", "--schema", "bot_a", "--reason", "r",
    ])
    .exits(0);
    // A directory has no schema; a schema without an outbox is not made one.
    cli(["upgrade-schema", &url, "--schema", "bot_b"])
        .exits(2)
        .complains("\"bot_b\" holds no outbox");
    let dir = tempfile::tempdir().unwrap();
    cli(["upgrade-schema", dir.path().to_str().unwrap()])
        .exits(2)
        .complains("a directory has no schema to upgrade");
}
