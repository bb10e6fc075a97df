//! `sql/schema.sql` says what the schema is after every migration: this test migrates a fresh
//! database, loads `sql/schema.sql` into an empty one, and compares the two catalogs
//! (functions as `pg_get_functiondef` prints them, columns, constraints, indexes, triggers,
//! tables' storage parameters), which is robust to the file's formatting.

use crate::common;

use common::{TestDb, first_column};

/// One line per catalog object of the `outbox` schema, sorted.
const CATALOG: &str = r#"
SELECT 'function ' || p.oid::regprocedure::text || E'\n' || pg_get_functiondef(p.oid)
FROM pg_proc p WHERE p.pronamespace = 'outbox'::regnamespace AND p.prokind IN ('f', 'p')
UNION ALL
SELECT format('column %s.%s %s%s%s%s%s', c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
              CASE WHEN a.attcollation NOT IN (0, t.typcollation)
                   THEN ' collate ' || a.attcollation::regcollation::text ELSE '' END,
              CASE WHEN a.attnotnull THEN ' not null' ELSE '' END,
              CASE WHEN a.attidentity <> '' THEN ' identity ' || a.attidentity::text ELSE '' END,
              coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), ''))
FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v')
UNION ALL
SELECT format('constraint %s %s %s', conrelid::regclass, conname, pg_get_constraintdef(oid))
FROM pg_constraint WHERE connamespace = 'outbox'::regnamespace
UNION ALL
SELECT 'index ' || pg_get_indexdef(i.indexrelid)
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE c.relnamespace = 'outbox'::regnamespace
UNION ALL
SELECT format('table %s %s', c.relname, c.reloptions::text)
FROM pg_class c WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind = 'r'
UNION ALL
SELECT 'trigger ' || pg_get_triggerdef(t.oid)
FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
WHERE c.relnamespace = 'outbox'::regnamespace AND NOT t.tgisinternal
ORDER BY 1
"#;

async fn catalog(db: &TestDb) -> Vec<String> {
    let client = db.client().await;
    first_column(&client, CATALOG).await
}

#[tokio::test]
async fn schema_sql_is_the_migrated_schema() {
    let migrated = TestDb::new().await;
    let documented = TestDb::empty().await;
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/sql/schema.sql")).unwrap();
    documented
        .client()
        .await
        .batch_execute(&text)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "sql/schema.sql does not load into an empty database: {e:?}; update sql/schema.sql"
            )
        });
    let want = catalog(&migrated).await;
    let got = catalog(&documented).await;
    let missing: Vec<&String> = want.iter().filter(|x| !got.contains(x)).collect();
    let extra: Vec<&String> = got.iter().filter(|x| !want.contains(x)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "sql/schema.sql no longer describes the schema the migrations build: update sql/schema.sql \
         (pg_dump --schema-only --schema=outbox --no-owner --no-privileges of a migrated database, \
         psql \\ lines removed).\nIn the migrated schema, not in sql/schema.sql:\n{}\nIn sql/schema.sql, not in the migrated schema:\n{}",
        missing
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        extra
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
    );
    assert!(
        want.iter().any(|s| s.starts_with("function ")),
        "the catalog query sees the functions"
    );
}
