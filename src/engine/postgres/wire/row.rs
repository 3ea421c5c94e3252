//! Rows: a `DataRow` read in binary format, decoded column by column with
//! `FromSql` against the types the statement's description gave.

use std::ops::Range;
use std::sync::Arc;

use postgres_protocol::message::backend::DataRowBody;
use postgres_types::{FromSql, Type};

use super::error::WireError;

/// One result column of a prepared statement.
#[derive(Debug)]
pub(crate) struct Column {
    pub(super) name: String,
    pub(super) ty: Type,
}

/// One row a statement returned.
pub(crate) struct Row {
    columns: Arc<[Column]>,
    body: DataRowBody,
    /// Each column's bytes in `body` (`None`: SQL `NULL`).
    ranges: Vec<Option<Range<usize>>>,
}

impl std::fmt::Debug for Row {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Row")
            .field("columns", &self.columns)
            .finish_non_exhaustive()
    }
}

/// How a column is named to [`Row::get`]: its position, or its name.
pub(crate) trait ColumnIndex: std::fmt::Display + Copy {
    /// The column's position among `columns`, if there is one.
    fn position(&self, columns: &[Column]) -> Option<usize>;
}

impl ColumnIndex for usize {
    fn position(&self, columns: &[Column]) -> Option<usize> {
        (*self < columns.len()).then_some(*self)
    }
}

impl ColumnIndex for &str {
    fn position(&self, columns: &[Column]) -> Option<usize> {
        columns.iter().position(|c| c.name == *self)
    }
}

impl Row {
    pub(super) fn new(columns: Arc<[Column]>, body: DataRowBody) -> Result<Self, WireError> {
        use fallible_iterator::FallibleIterator;
        let ranges: Vec<Option<Range<usize>>> = body
            .ranges()
            .collect()
            .map_err(|e| WireError::protocol(format!("a malformed row: {e}")))?;
        if ranges.len() != columns.len() {
            return Err(WireError::protocol(format!(
                "a row of {} columns for a statement of {}",
                ranges.len(),
                columns.len()
            )));
        }
        Ok(Self {
            columns,
            body,
            ranges,
        })
    }

    /// How many columns the row has.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.columns.len()
    }

    /// Column `idx` as a `T`.
    ///
    /// # Panics
    /// When there is no such column, or it cannot be read as a `T` (a bug in
    /// the statement or in its caller, as for `postgres::Row::get`).
    pub(crate) fn get<'a, I, T>(&'a self, idx: I) -> T
    where
        I: ColumnIndex,
        T: FromSql<'a>,
    {
        match self.try_get(idx) {
            Ok(value) => value,
            Err(e) => panic!("reading a column: {e}"),
        }
    }

    /// Column `idx` as a `T`.
    ///
    /// # Errors
    /// No such column, a type that does not read as a `T`, or a value that
    /// does not decode.
    pub(crate) fn try_get<'a, I, T>(&'a self, idx: I) -> Result<T, WireError>
    where
        I: ColumnIndex,
        T: FromSql<'a>,
    {
        let Some(at) = idx.position(&self.columns) else {
            return Err(WireError::column(format!("no column {idx}")));
        };
        let ty = &self.columns[at].ty;
        if !T::accepts(ty) {
            return Err(WireError::column(format!(
                "column {idx} is of type {ty}, not readable as {}",
                std::any::type_name::<T>()
            )));
        }
        let raw = self.ranges[at].clone().map(|r| &self.body.buffer()[r]);
        T::from_sql_nullable(ty, raw)
            .map_err(|e| WireError::column(format!("column {idx} ({ty}): {e}")))
    }
}
